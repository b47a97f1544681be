"""The node parameter server against a plain in-memory table of the same optimizer."""
import fcntl
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import hps

DIM = 4


def config(path, **kw):
    kw.setdefault("optimizer", hps.Adam(lr=0.05))
    kw.setdefault("mem_budget", 80 * (DIM * 3 + 1) * 4 + 80 * 112)  # ~80 rows of 300 keys: SSD traffic
    kw.setdefault("ssd", hps.SsdOptions(file_records=64))
    kw.setdefault("write_buffer_rows", 16)
    return hps.ParameterServerConfig(dim=DIM, path=str(path), seed=11, **kw)


def reference(cfg):
    return hps.EmbeddingTable(100_000, DIM, optimizer=cfg.optimizer, initializer=cfg.initializer, seed=cfg.seed)


def random_steps(seed, steps, universe=300):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        keys = rng.integers(0, universe, rng.integers(1, 60)).astype(np.uint64)
        grads = rng.standard_normal((len(keys), DIM)).astype(np.float32)
        yield keys, grads


@pytest.mark.parametrize("devices,in_place", [(1, True), (1, False), (2, False), (4, False)])
def test_matches_an_in_memory_table_through_eviction_and_reopen(tmp_path, devices, in_place):
    cfg = config(tmp_path / "ps", devices=devices, host_in_place=in_place)
    ps, ref = hps.ParameterServer(cfg), reference(cfg)
    probe = np.arange(300, dtype=np.uint64)
    for step, (keys, grads) in enumerate(random_steps(devices, 60)):
        ps.push(keys, grads)
        ref.push(keys, grads)
        np.testing.assert_array_equal(ps.pull(keys), ref.pull(keys), err_msg=f"step {step}")
        if step == 30:
            ps.checkpoint()
            ps.close()
            ps = hps.ParameterServer.open(cfg.path)
    np.testing.assert_array_equal(ps.pull(probe), ref.pull(probe))
    s = ps.stats()
    assert s["device"]["kind"] == ("host, in place (MEM-PS rows)" if in_place else "cpu")
    assert s["mem"]["dirty_evictions"] > 0 and s["counts"]["ssd_hits"] > 0 and s["counts"]["ssd_puts"] > 0, s
    if devices > 1:
        moved = np.array(s["device"]["transfer_rows"])
        assert moved.shape == (devices, devices) and moved.sum() > 0
    ps.checkpoint()
    ps.close()
    reopened = hps.ParameterServer.open(cfg.path, mem_budget="1MiB", devices=2)
    np.testing.assert_array_equal(reopened.pull(probe), ref.pull(probe))


def test_batches_sum_gradients_of_all_workers_then_step_once(tmp_path):
    cfg = config(tmp_path / "ps", devices=2, optimizer=hps.AdaGrad(lr=0.1))
    ps, ref = hps.ParameterServer(cfg), reference(cfg)
    keys = np.array([1, 2, 3, 4, 5, 6], np.uint64)
    g = np.arange(6 * DIM, dtype=np.float32).reshape(6, DIM) / 10
    with ps.batch(keys) as b:
        np.testing.assert_array_equal(b.pull(keys[:3], worker=0), ref.pull(keys[:3]))
        b.push(keys[:4], g[:4], worker=0)
        b.push(keys[2:], g[2:], worker=1)  # keys 3 and 4 get gradients from both workers
    summed = g.copy()
    summed[2:4] += g[2:4]
    ref.push(keys, summed)
    np.testing.assert_array_equal(ps.pull(keys), ref.pull(keys))
    moved = np.array(ps.stats()["device"]["transfer_rows"])
    assert moved.sum() == 3 + 4 + 4  # rows pulled + gradients sent


@pytest.mark.parametrize("dim", [3, 6, 16])
def test_an_in_place_batch_sums_repeated_keys_at_any_row_width(tmp_path, dim):
    """The in-place batch sums a key's gradients four floats at a time and the
    rest one by one: widths below 4, between multiples of 4 and a multiple, each
    against the in-memory table given the sums."""
    cfg = hps.ParameterServerConfig(dim=dim, path=str(tmp_path / "ps"), seed=11, optimizer=hps.SGD(lr=0.5),
                                    mem_budget="1MiB", host_in_place=True)
    ps = hps.ParameterServer(cfg)
    ref = hps.EmbeddingTable(1000, dim, optimizer=cfg.optimizer, initializer=cfg.initializer, seed=cfg.seed)
    keys = np.array([9, 4, 9, 7, 9, 4], np.uint64)
    g = (np.arange(len(keys) * dim, dtype=np.float32).reshape(len(keys), dim) + 1) / 8
    ps.push(keys, g)
    distinct = np.array([4, 7, 9], np.uint64)
    summed = np.stack([g[keys == k].sum(0) for k in distinct])
    ref.push(distinct, summed)
    assert ps.stats()["device"]["kind"] == "host, in place (MEM-PS rows)"
    np.testing.assert_array_equal(ps.pull(distinct), ref.pull(distinct))
    ps.close()


@pytest.mark.parametrize("in_place", [True, False])
def test_an_aborted_batch_changes_nothing(tmp_path, in_place):
    cfg = config(tmp_path / "ps", host_in_place=in_place)
    ps = hps.ParameterServer(cfg)
    keys = np.array([5, 6], np.uint64)
    before = ps.pull(keys)
    with pytest.raises(RuntimeError, match="boom"):
        with ps.batch(keys) as b:
            b.push(keys, np.ones((2, DIM), np.float32))
            raise RuntimeError("boom")
    np.testing.assert_array_equal(ps.pull(keys), before)
    assert ps.stats()["mem"]["pinned"] == 0


@pytest.mark.parametrize("devices,in_place", [(1, True), (1, False), (2, False)])
def test_a_gradient_sum_that_overflows_is_refused_naming_the_key_and_no_row_steps(tmp_path, devices, in_place):
    """Key 5's two gradients in one push, 2e38 each, are finite, but their sum is an
    infinity: the step made the row -inf (and NaN at the next one), which every later
    pull and checkpoint held, with no error; so did a NaN pushed. The step refuses
    the sum now, naming the key, before any row of the push changes (key 6, whose
    sum is finite, neither), and the server trains on."""
    cfg = config(tmp_path / "ps", devices=devices, host_in_place=in_place, optimizer=hps.SGD(lr=0.5))
    ps = hps.ParameterServer(cfg)
    distinct = np.array([5, 6], np.uint64)
    before = ps.pull(distinct)
    keys = np.array([6, 5, 5], np.uint64)
    grads = np.ones((3, DIM), np.float32)
    grads[1:] = 2e38
    with pytest.raises(hps.DivergedError, match=r" apply: 4 non-finite values in the summed gradients of 1 key "
                                                r"\(key 5 first: inf\): training diverged"):
        ps.push(keys, grads)
    grads[1:] = 1.0
    grads[2, 3] = np.nan
    with pytest.raises(hps.DivergedError, match=r"1 non-finite value in the summed gradients of 1 key \(key 5 "
                                                r"first: nan\)"):
        ps.push(keys, grads)
    np.testing.assert_array_equal(ps.pull(distinct), before)
    assert ps.stats()["mem"]["pinned"] == 0
    ps.push(keys, np.ones((3, DIM), np.float32))
    np.testing.assert_array_equal(ps.pull(distinct), before - 0.5 * np.array([[2.0], [1.0]], np.float32))
    ps.close()


@pytest.mark.parametrize("devices,in_place", [(1, True), (1, False), (2, False)])
def test_a_step_that_would_leave_a_row_not_finite_is_refused_naming_the_key_and_no_row_steps(tmp_path, devices,
                                                                                           in_place):
    """Key 5's gradient sum, 2e20 a value, is finite, but its square is not: AdaGrad's
    sum of squares became inf, after which the row never moved again (lr * g / inf),
    and every later pull and checkpoint held it, with no error. The step refuses it
    now, naming the key and the value, before any row of the push changes (key 6's
    neither), and the server trains on: the rows then step as from where they were."""
    cfg = config(tmp_path / "ps", devices=devices, host_in_place=in_place, optimizer=hps.AdaGrad(lr=0.1))
    ps = hps.ParameterServer(cfg)
    distinct = np.array([5, 6], np.uint64)
    before = ps.pull(distinct)
    keys = np.array([6, 5, 5], np.uint64)
    grads = np.ones((3, DIM), np.float32)
    grads[1:] = 1e20
    with pytest.raises(hps.DivergedError, match=r" apply: the step of 1 key would leave a value that is not finite "
                                                r"in its row \(key 5 first: its AdaGrad sum of squared gradients, "
                                                r"column 0, would be inf\): training diverged"):
        ps.push(keys, grads)
    np.testing.assert_array_equal(ps.pull(distinct), before)
    assert ps.stats()["mem"]["pinned"] == 0
    ps.push(keys, np.ones((3, DIM), np.float32))  # sums 1 and 2: each row steps by lr g / sqrt(g * g) = 0.1
    np.testing.assert_allclose(ps.pull(distinct), before - np.float32(0.1), rtol=0, atol=1e-6)
    ps.close()


@pytest.mark.parametrize("topology", [None, "figure1.toml"])
def test_a_push_of_a_key_not_in_the_batch_is_refused_and_the_batch_trains_on(tmp_path, topology):
    """A batch's push of a key it does not hold: host partitions that step the rows in
    place refused it, but through executed routes (figure1's; every CUDA tier too) the
    tier summed its gradient, and the batch's apply stepped its rows and claimed one for
    the key before it named the key (IndexError), releasing the batch. Both refuse the
    push now, naming the key, and add nothing of it: the batch trains on."""
    topo = None if topology is None else os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                                      "examples", "topologies", topology)
    ps = hps.ParameterServer(config(tmp_path / "ps", devices=8, topology=topo, optimizer=hps.SGD(lr=0.5)))
    keys = np.arange(1, 20, dtype=np.uint64)
    before = ps.pull(keys)
    b = ps.batch(keys)
    assert b.gathers_into_columns == (topology is None)  # in place, or through the row mover
    with pytest.raises(IndexError, match=r"^device tier accumulate: keys\[1\] = 999 is not among the 19 keys bound$"):
        b.push(np.array([3, 999], np.uint64), np.ones((2, DIM), np.float32))
    b.push(keys[:2], np.ones((2, DIM), np.float32))
    b.finish()
    np.testing.assert_array_equal(ps.pull(keys), before - np.float32(0.5) * (np.arange(19) < 2)[:, None])
    assert ps.stats()["mem"]["pinned"] == 0
    ps.close()


def test_eps_0_is_refused_where_the_server_is_made(tmp_path):
    """eps = 0 with a sum of squares (AdaGrad's, from initial_accumulator_value 0) or a
    second moment (Adam's) still 0 stepped a key pushed with a zero gradient by 0 / 0:
    NaN for good. hps train refused it only under admission; a ParameterServer made
    directly took it. Refused where the optimizer is made, naming eps, before the
    server makes anything at its path."""
    for optimizer in (hps.AdaGrad(eps=0.0), hps.RowWiseAdaGrad(eps=0.0), hps.Adam(eps=0.0)):
        with pytest.raises(ValueError, match=r"optimizer: eps must be a finite number > 0"):
            hps.ParameterServer(config(tmp_path / "ps", optimizer=optimizer))
        assert not (tmp_path / "ps").exists()


CRASHER = textwrap.dedent("""
    import sys, numpy as np, hps
    sys.path.insert(0, {tests!r})
    from test_parameter_server import config, random_steps
    ps = hps.ParameterServer(config(sys.argv[1]))
    for step, (keys, grads) in enumerate(random_steps(5, 40)):
        ps.push(keys, grads)
        if step == 19:
            ps.checkpoint()
            print("checkpointed", flush=True)
    print("done", flush=True)
    import os, signal
    os.kill(os.getpid(), signal.SIGKILL)  # updates after the checkpoint are in flight
""").format(tests=os.path.dirname(os.path.abspath(__file__)))


def test_a_crash_loses_only_what_followed_the_checkpoint(tmp_path):
    path = tmp_path / "ps"
    run = subprocess.run([sys.executable, "-c", CRASHER, str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert run.stdout.split() == ["checkpointed", "done"]
    cfg = config(path)
    ref = reference(cfg)
    for step, (keys, grads) in enumerate(random_steps(5, 20)):
        ref.push(keys, grads)
    ps = hps.ParameterServer.open(path)
    probe = np.arange(300, dtype=np.uint64)
    np.testing.assert_array_equal(ps.pull(probe), ref.pull(probe))


HOLDER = textwrap.dedent("""
    import sys, time
    import hps
    sys.path.insert(0, {tests!r})
    from test_parameter_server import config
    ps = hps.ParameterServer(config(sys.argv[1]))
    print("open", flush=True)
    time.sleep(120)
""").format(tests=os.path.dirname(os.path.abspath(__file__)))


def test_a_second_server_at_one_path_is_refused_naming_the_holder_until_it_lets_go(tmp_path):
    """Two servers at one path would write parameter files of the same numbers and
    each other's MANIFEST. Another process's is refused naming its pid; a killed
    holder lets go (the kernel drops its lock); one in this process lets go at
    close(), or when dropped."""
    path = tmp_path / "ps"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(hps.PathInUseError, match=f"{path}: another parameter server has this path open "
                                                      f"\\(pid {holder.pid} on "):
            hps.ParameterServer(config(path))
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    ps = hps.ParameterServer(config(path))  # the killed holder's lock went with it
    keys, grads = next(random_steps(1, 1))
    ps.push(keys, grads)
    ps.checkpoint()
    with pytest.raises(hps.PathInUseError, match=f"pid {os.getpid()} on "):
        hps.ParameterServer(config(path))
    want = ps.pull(keys)
    ps.close()
    again = hps.ParameterServer(config(path))
    np.testing.assert_array_equal(again.pull(keys), want)
    del again  # dropped without close(): the next one opens
    hps.ParameterServer(config(path)).close()


def remove_before_the_next_lock(monkeypatch, path, remove):
    """Makes the next flock of hps.parameter_server first lock the path's lock
    file as another process would, remove(the lock file), and let go: a removal
    between a locker's open of the file and its lock."""
    from types import SimpleNamespace
    from hps.parameter_server import WRITER_LOCK
    lock = str(path / WRITER_LOCK)

    def removed_first(fd, op):
        monkeypatch.setattr(hps.parameter_server, "fcntl", fcntl)
        remover = os.open(lock, os.O_RDWR)
        fcntl.flock(remover, fcntl.LOCK_EX | fcntl.LOCK_NB)
        remove(lock)
        os.close(remover)
        fcntl.flock(fd, op)
    monkeypatch.setattr(hps.parameter_server, "fcntl", SimpleNamespace(flock=removed_first, LOCK_EX=fcntl.LOCK_EX,
                                                                       LOCK_NB=fcntl.LOCK_NB))


def test_a_lock_file_removed_between_a_servers_open_and_its_lock_gives_no_second_holder(tmp_path, monkeypatch):
    """A process that removes a path's lock file does so holding it (a discarded run's
    files, a reshard's rank directories). A server that opened the file just before and
    locked it just after held the lock of a file no path named: the next server created
    a new file and locked that, and two servers wrote at one path. A lock counts only
    while the path still names the file locked; else it is taken again."""
    path = tmp_path / "ps"
    hps.ParameterServer(config(path)).close()  # (its lock file stays)
    remove_before_the_next_lock(monkeypatch, path, os.unlink)
    first = hps.ParameterServer(config(path))
    assert hps.parameter_server.fcntl is fcntl  # (the removal ran)
    with pytest.raises(hps.PathInUseError, match=f"{path}: another parameter server has this path open "
                                                  f"\\(pid {os.getpid()} on "):
        hps.ParameterServer(config(path))
    first.close()
    hps.ParameterServer(config(path)).close()


def test_a_directory_removed_between_a_lockers_open_and_its_lock_is_named(tmp_path, monkeypatch):
    """A reshard removes a rank's directory holding its lock: a server that was taking
    the lock meanwhile is refused naming the path, not left holding a removed file's."""
    import shutil
    path = tmp_path / "ps"
    hps.ParameterServer(config(path)).close()
    remove_before_the_next_lock(monkeypatch, path, lambda lock: shutil.rmtree(os.path.dirname(lock)))
    with pytest.raises(hps.PathInUseError, match=f"{path}: another run removed this directory while this one was "
                                                  f"taking its writer lock; run again"):
        hps.parameter_server._lock_path(str(path))
    assert not path.exists()


MID_CHECKPOINT = textwrap.dedent("""
    import os, signal, sys
    import hps
    sys.path.insert(0, {tests!r})
    from test_parameter_server import config, random_steps
    ps = hps.ParameterServer(config(sys.argv[1]))
    for step, (keys, grads) in enumerate(random_steps(5, 40)):
        ps.push(keys, grads)
        if step == 19:
            ps.checkpoint()
            print("checkpointed", flush=True)
    die = lambda *args, **kw: os.kill(os.getpid(), signal.SIGKILL)
    where = sys.argv[2]
    if where == "after the store's commit":
        ps._snapshot_store = die
    elif where == "in the middle of the snapshot":
        link, calls = os.link, []
        os.link = lambda *a, **kw: die() if len(calls) == 3 else (calls.append(1), link(*a, **kw))
    elif where == "before the metadata names it":
        ps._write_metadata = die
    elif where == "after the metadata names it":
        ps._prune = die
    ps.checkpoint()
    print("done", flush=True)
""").format(tests=os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("where", ["after the store's commit", "in the middle of the snapshot",
                                   "before the metadata names it", "after the metadata names it"])
def test_a_crash_in_the_middle_of_a_checkpoint_rolls_back_to_the_one_before(tmp_path, where):
    """The second checkpoint dies at `where`: until the metadata names it, the
    server opens at the first checkpoint (step 19), with no trace of the second."""
    path = tmp_path / "ps"
    run = subprocess.run([sys.executable, "-c", MID_CHECKPOINT, str(path), where], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert run.stdout.split() == ["checkpointed"]
    done = 40 if where == "after the metadata names it" else 20
    cfg = config(path)
    ref = reference(cfg)
    for keys, grads in random_steps(5, done):
        ref.push(keys, grads)
    probe = np.arange(300, dtype=np.uint64)
    ps = hps.ParameterServer.open(path)
    assert ps.checkpoint_number == done // 20
    np.testing.assert_array_equal(ps.pull(probe), ref.pull(probe))
    assert sorted(os.listdir(path / hps.parameter_server.CHECKPOINTS)) == [f"{done // 20:06d}"]
    # It goes on from there: more steps, a checkpoint, a reopen.
    for keys, grads in random_steps(6, 10):
        ps.push(keys, grads)
        ref.push(keys, grads)
    assert ps.checkpoint() == done // 20 + 1
    ps.close()
    ps = hps.ParameterServer.open(path)
    np.testing.assert_array_equal(ps.pull(probe), ref.pull(probe))
    assert sorted(os.listdir(path / hps.parameter_server.CHECKPOINTS)) == [f"{done // 20 + 1:06d}"]


def test_a_checkpoint_outlives_the_compactions_that_delete_its_files(tmp_path):
    """Compactions after a checkpoint delete the store's files it holds; a server
    opened again gets the checkpoint back from its own links. Opened at a
    chosen checkpoint (an MPI job's), the later ones are dropped."""
    cfg = config(tmp_path / "ps", ssd=hps.SsdOptions(file_records=16, compaction_trigger=1.1))
    ps, ref = hps.ParameterServer(cfg), reference(cfg)
    probe = np.arange(300, dtype=np.uint64)
    for keys, grads in random_steps(7, 20):
        ps.push(keys, grads)
        ref.push(keys, grads)
    assert ps.checkpoint(keep_previous=True) == 1
    at_first = ref.pull(probe)
    snapshot = os.path.join(ps.checkpoint_dir(1), "ssd")
    files = {f for f in os.listdir(snapshot) if f.endswith(".hpf")}
    for keys, grads in random_steps(8, 20):
        ps.push(keys, grads)
        ref.push(keys, grads)
        ps.checkpoint(keep_previous=True)  # commits: compactions run and delete files
    ps._ssd.wait_for_compaction()
    assert ps._ssd.stats()["compactions"] > 0
    live = {f for f in os.listdir(os.path.join(cfg.path, "ssd")) if f.endswith(".hpf")}
    assert files - live, "no file of checkpoint 1 was compacted away"
    assert ps.checkpoint_number == 21 and len(os.listdir(os.path.join(cfg.path, "checkpoints"))) == 21
    ps.close()
    ps = hps.ParameterServer(cfg, checkpoint=1)
    np.testing.assert_array_equal(ps.pull(probe), at_first)
    assert ps.checkpoint_number == 1 and os.listdir(os.path.join(cfg.path, "checkpoints")) == ["000001"]
    ps.close()
    with pytest.raises(FileNotFoundError, match="checkpoint 5 of .* is missing"):
        hps.ParameterServer(cfg, checkpoint=5)
    ps = hps.ParameterServer(cfg, checkpoint=None)  # none: empty, as new
    assert ps.checkpoint_number is None and not os.path.exists(os.path.join(cfg.path, "checkpoints", "000001"))
    np.testing.assert_array_equal(ps.pull(probe), reference(cfg).pull(probe))


def test_a_finished_checkpoint_survives_a_power_loss_from_the_directories_made_for_its_path(tmp_path,
                                                                                            monkeypatch):
    """Every directory entry that a finished checkpoint is reached by is synced
    before the metadata names it (a rename, which may reach the disk before any
    sync): the directories made for a new path (and above it) and checkpoints/
    too. Their names were synced late or never, so a power loss could take the
    whole job directory after the checkpoint returned (an fsync of a directory
    does not persist its own entry in the one above it), or leave metadata naming
    a checkpoint that checkpoints/ was lost with. The page cache hides this from
    any reopen, so the calls are logged (tests/durable_names.py)."""
    from durable_names import NameLog
    log = NameLog(monkeypatch)
    path = tmp_path / "new" / "deeper" / "ps"
    ps = hps.ParameterServer(config(path))
    for keys, grads in random_steps(9, 10):
        ps.push(keys, grads)
    ps.checkpoint()
    ps.close()
    assert log.unsynced(tmp_path, before=log.index_of_entry(path / hps.parameter_server.METADATA)) == []
    assert log.unsynced(tmp_path) == []


def test_a_checkpoint_whose_metadata_sync_failed_is_not_removed_by_the_next_one(tmp_path, monkeypatch):
    """Checkpoint 2's metadata is renamed into place, then the sync of its directory
    fails (EIO): checkpoint() raises, and the metadata names 2 (the rename may
    stand). The server still took 1 for its last, so the next checkpoint was
    numbered 2 again and removed checkpoint 2 as a leftover first: failing too
    (ENOSPC in its snapshot, here), it left metadata naming a checkpoint that was
    gone, and the server would not open. It is numbered 3 now, and the server
    opens at 2."""
    import errno
    import json
    from hps import parameter_server as hps_ps
    cfg = config(tmp_path / "ps")
    ps, ref = hps.ParameterServer(cfg), reference(cfg)
    probe = np.arange(300, dtype=np.uint64)
    for seed in (10, 11):
        for keys, grads in random_steps(seed, 10):
            ps.push(keys, grads)
            ref.push(keys, grads)
        if seed == 10:
            assert ps.checkpoint() == 1
    at_two = ref.pull(probe)
    metadata, real_sync = os.path.join(cfg.path, hps_ps.METADATA), hps_ps._sync_dir

    def sync_fails_once_the_metadata_names_2(path):
        with open(metadata) as f:
            if os.path.samefile(path, cfg.path) and json.load(f)["checkpoint"] == 2:
                raise OSError(errno.EIO, "sync directory: Input/output error", path)
        real_sync(path)

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    for failing, fn, said in (("_sync_dir", sync_fails_once_the_metadata_names_2, "Input/output error"),
                              ("_snapshot_store", no_space, "No space left")):
        with monkeypatch.context() as m:
            m.setattr(hps_ps if failing == "_sync_dir" else hps.ParameterServer, failing, fn)
            with pytest.raises(OSError, match=said):
                ps.checkpoint()
    ps.close()
    ps = hps.ParameterServer.open(cfg.path)
    assert ps.checkpoint_number == 2
    np.testing.assert_array_equal(ps.pull(probe), at_two)


def test_a_rank_of_a_job_opens_at_the_checkpoint_job_json_names(tmp_path):
    """A server at ``<job>/rank<r>`` (r below job.json's world) opened at its last
    checkpoint opens at the one job.json names, which the job resumes every rank at:
    opened at its metadata's, the job's was dropped and the job could not resume.
    Here rank 0 finished checkpoint 2 (its metadata names it), job.json names 1 (the
    job died before naming 2); and the other way round, a reshard's switch: job.json
    names 2, the metadata 1. A job.json that is no record is named, and a checkpoint
    job.json names that the rank lacks is refused: nothing dropped. (A rank job.json
    lacks, r >= world: test_a_directory_no_rank_of_its_job_is_refused_as_its_readers_refuse_it.)"""
    import json
    job = tmp_path / "job"
    rank0 = job / "rank0"
    cfg = config(rank0)
    probe = np.arange(300, dtype=np.uint64)
    ps = hps.ParameterServer(cfg)
    for keys, grads in random_steps(7, 5):
        ps.push(keys, grads)
    assert ps.checkpoint(keep_previous=True) == 1
    at_first = ps.pull(probe)
    for keys, grads in random_steps(8, 5):
        ps.push(keys, grads)
    assert ps.checkpoint(keep_previous=True) == 2
    ps.close()
    checkpoints = rank0 / "checkpoints"
    names = sorted(os.listdir(checkpoints))
    files = {n: sorted(os.listdir(checkpoints / n / "ssd")) for n in names}

    def write_job(world, number):
        (job / "job.json").write_text(json.dumps({"world": world, "step": 5, "checkpoint": number}))

    def opens_at(number):  # rank 0 opened at LAST: at `number`, the rows of checkpoint 1, no other kept
        ps = hps.ParameterServer.open(rank0)
        assert ps.checkpoint_number == number
        np.testing.assert_array_equal(ps.pull(probe), at_first)
        ps.close()
        assert os.listdir(checkpoints) == [f"{number:06d}"]

    write_job(1, 1)
    with pytest.raises(ValueError, match="job.json: not JSON"):
        (job / "job.json").write_text("{")
        hps.ParameterServer.open(rank0)
    assert sorted(os.listdir(checkpoints)) == names
    write_job(1, 3)
    with pytest.raises(FileNotFoundError, match="job.json names checkpoint 3 of this rank, which is missing.*its "
                                                "metadata names 2: nothing was dropped"):
        hps.ParameterServer.open(rank0)
    assert sorted(os.listdir(checkpoints)) == names
    write_job(1, 1)
    opens_at(1)

    # The switch's order: job.json names 2, which the rank holds beside its metadata's 1.
    os.makedirs(checkpoints / "000002" / "ssd")
    for name in files["000001"]:
        os.link(checkpoints / "000001" / "ssd" / name, checkpoints / "000002" / "ssd" / name)
    for name in set(os.listdir(checkpoints / "000001")) - {"ssd"}:
        os.link(checkpoints / "000001" / name, checkpoints / "000002" / name)
    write_job(1, 2)
    opens_at(2)


def test_a_rank_opened_directly_keeps_the_checkpoint_job_json_names_through_its_writes(tmp_path):
    """A rank of a 2-rank job (job.json names checkpoint 1) opened directly, pushed
    to and checkpointed: a plain checkpoint() dropped checkpoint 1, and the job
    could no longer resume or be served. It is refused, naming the job, writing
    nothing; checkpoint(keep_previous=True) (the job's own protocol) and
    prune_checkpoints() keep checkpoint 1, which the next open goes back to; so do
    an open at another checkpoint and a start over (checkpoint=None)."""
    import json
    job = tmp_path / "job"
    rank0 = job / "rank0"
    probe = np.arange(300, dtype=np.uint64)
    ps = hps.ParameterServer(config(rank0))
    for keys, grads in random_steps(3, 5):
        ps.push(keys, grads)
    assert ps.checkpoint(keep_previous=True) == 1
    at_first = ps.pull(probe)
    ps.close()
    (job / "job.json").write_text(json.dumps({"world": 2, "step": 5, "checkpoint": 1}))
    checkpoints = rank0 / "checkpoints"
    listing = sorted(os.listdir(rank0)), sorted(os.listdir(checkpoints))

    ps = hps.ParameterServer.open(rank0)
    ps.push(probe[:8], np.ones((8, DIM), np.float32))
    with pytest.raises(ValueError, match=rf"checkpoint: {rank0} is a rank of the job at {job}, whose "
                                         rf"{job / 'job.json'} names checkpoint 1.*Nothing was written"):
        ps.checkpoint()
    assert (sorted(os.listdir(rank0)), sorted(os.listdir(checkpoints))) == listing
    assert ps.checkpoint(keep_previous=True) == 2
    ps.prune_checkpoints()
    assert sorted(os.listdir(checkpoints)) == ["000001", "000002"]
    ps.close()
    ps = hps.ParameterServer.open(rank0)  # at job.json's, as the job resumes every rank
    assert ps.checkpoint_number == 1
    np.testing.assert_array_equal(ps.pull(probe), at_first)
    ps.close()
    assert os.listdir(checkpoints) == ["000001"]

    hps.ParameterServer(config(rank0), checkpoint=None).close()  # a start over keeps it too
    assert os.listdir(checkpoints) == ["000001"]
    ps = hps.ParameterServer(config(rank0), checkpoint=1)
    np.testing.assert_array_equal(ps.pull(probe), at_first)
    ps.close()

    # Once job.json names no checkpoint of the rank (none yet), it is its own.
    (job / "job.json").write_text(json.dumps({"world": 2, "step": 0, "checkpoint": None}))
    rank1 = job / "rank1"
    ps = hps.ParameterServer(config(rank1))
    ps.push(probe[:4], np.ones((4, DIM), np.float32))
    assert ps.checkpoint() == 1 and ps.checkpoint() == 2
    ps.close()
    assert os.listdir(rank1 / "checkpoints") == ["000002"]


def test_a_directory_no_rank_of_its_job_is_refused_as_its_readers_refuse_it(tmp_path):
    """``<job>/rank1`` once the job has 1 rank (a reshard to fewer ranks left it to
    remove), a new ``<job>/rank2`` of it, and a rank directory beside a reshard to
    one process's resharded-from.json: hps inspect, export and Lookup refuse each
    (hps.jobdir), naming the directory and the job. A ParameterServer opened there
    resumed at the directory's own checkpoint (or made a new server) and took writes
    that nothing of the job reads, and that the next resume removes or a reshard to
    more ranks empties. It is refused alike (FileNotFoundError naming the directory,
    job.json and its world), at every checkpoint asked for, changing nothing; a new
    directory is not made."""
    import json
    from hps.jobdir import RESHARDED_FILE, read_job
    job = tmp_path / "job"
    rank1 = job / "rank1"
    probe = np.arange(50, dtype=np.uint64)
    ps = hps.ParameterServer(config(rank1))  # (rank 1 of a job of 2 ranks)
    ps.push(probe, np.ones((len(probe), DIM), np.float32))
    assert ps.checkpoint(keep_previous=True) == 1
    ps.close()
    (job / "job.json").write_text(json.dumps({"world": 1, "step": 5, "checkpoint": 1}))

    def listing():
        return sorted(str(p.relative_to(job)) for p in job.rglob("*"))
    before = listing()
    no_rank = (f"{rank1} is no rank of the job at {job}, which has 1 ranks ({job / 'job.json'}): what it holds "
               f"is what a reshard left to remove or is writing, not the job's checkpoint")
    with pytest.raises(FileNotFoundError, match=re.escape(no_rank)):
        read_job(str(rank1))  # (the readers' refusal)
    for opening in (lambda: hps.ParameterServer.open(rank1), lambda: hps.ParameterServer(config(rank1)),
                    lambda: hps.ParameterServer(config(rank1), checkpoint=1),
                    lambda: hps.ParameterServer(config(rank1), checkpoint=None)):
        with pytest.raises(FileNotFoundError, match=re.escape(no_rank) + r".*open the job at .*rank0 to rank0"):
            opening()
        assert listing() == before
    with pytest.raises(FileNotFoundError, match=re.escape(f"{job / 'rank2'} is no rank of the job at {job}")):
        hps.ParameterServer(config(job / "rank2"))
    assert listing() == before  # (rank2 not made)

    (job / "job.json").rename(job / RESHARDED_FILE)  # (a reshard to one process's switch)
    before = listing()
    with pytest.raises(FileNotFoundError, match=re.escape(f"{rank1} was rank 1 of the job at {job} before its "
                                                          f"reshard to one process ({job / RESHARDED_FILE})")):
        hps.ParameterServer.open(rank1)
    assert listing() == before

    (job / RESHARDED_FILE).rename(job / "job.json")
    (job / "job.json").write_text(json.dumps({"world": 2, "step": 5, "checkpoint": 1}))  # (a rank of it again)
    ps = hps.ParameterServer.open(rank1)
    assert ps.checkpoint_number == 1
    ps.close()


@pytest.mark.parametrize("record,named", [
    ("{", "not JSON"),
    ("[2, 1]", "not a job record (a JSON list, not an object)"),
    ('{"checkpoint": 1}', "no field 'world'"),
    ('{"world": 1}', "no field 'checkpoint'"),
    ('{"world": "one", "checkpoint": 1}', "field 'world' must be a number of ranks >= 1, got 'one'"),
    ('{"world": 0, "checkpoint": 1}', "field 'world' must be a number of ranks >= 1, got 0"),
    ('{"world": 1, "checkpoint": "1"}', "field 'checkpoint' must be a checkpoint number or null, got '1'"),
    ('{"world": 1, "checkpoint": 1.5}', "field 'checkpoint' must be a checkpoint number or null, got 1.5"),
    ('{"world": 1, "checkpoint": 1, "step": "4"}', "field 'step' must be a number of batches or null, got '4'"),
    ('{"world": 1, "checkpoint": 1, "run": 7}', "field 'run' must be a run id or null, got 7"),
])
def test_a_damaged_job_json_is_named_alike_by_the_job_s_readers_and_a_rank_s_server(tmp_path, record, named):
    """job.json is parsed once (hps.jobdir.read_job_record): hps inspect, export and
    Lookup (read_job) and a server opened on a rank's directory refuse a damaged
    one with the same error, naming the file and the field. Parsed twice, the
    readers let a checkpoint "1" through to fail later unnamed and gave int()'s
    bare message for a world "one", while the server took "1" for 1."""
    from hps.jobdir import read_job
    job = tmp_path / "job"
    rank0 = job / "rank0"
    ps = hps.ParameterServer(config(rank0))
    ps.push(np.arange(4, dtype=np.uint64), np.ones((4, DIM), np.float32))
    assert ps.checkpoint(keep_previous=True) == 1
    ps.close()
    (job / "job.json").write_text(record)
    with pytest.raises(ValueError) as by_reader:
        read_job(str(job))
    with pytest.raises(ValueError) as by_server:
        hps.ParameterServer.open(rank0)
    assert str(by_reader.value) == str(by_server.value)
    assert str(by_reader.value).startswith(f"{job / 'job.json'}: {named}"), str(by_reader.value)
    assert os.listdir(rank0 / "checkpoints") == ["000001"]  # (the refused open dropped nothing)


def test_errors_name_what_is_wrong(tmp_path):
    cfg = config(tmp_path / "ps")
    ps = hps.ParameterServer(cfg)
    with pytest.raises(ValueError, match=r"keys\[1\] is 0xffffffffffffffff"):
        ps.pull(np.array([1, hps.EMPTY_KEY], np.uint64))
    with pytest.raises(ValueError, match=r"keys\[0\] is 0xffffffffffffffff"):
        ps.push(np.array([hps.EMPTY_KEY], np.uint64), np.zeros((1, DIM), np.float32))
    with pytest.raises(TypeError, match="grads must be an array of float32, got float64"):
        ps.push(np.array([1], np.uint64), np.zeros((1, DIM)))
    with pytest.raises(ValueError, match=r"grads must have shape \(2, 4\), got \(2, 3\)"):
        ps.push(np.array([1, 2], np.uint64), np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match="keys must be an array of uint64 or int64, got float64"):
        ps.push(np.array([1.0]), np.zeros((1, DIM), np.float32))
    with pytest.raises(hps.CacheFullError, match="MEM-PS budget too small"):
        ps.push(np.arange(1000, dtype=np.uint64), np.zeros((1000, DIM), np.float32))
    assert ps.stats()["mem"]["pinned"] == 0
    ps.push(np.array([1], np.uint64), np.ones((1, DIM), np.float32))  # still works
    small_devices = config(tmp_path / "ps2", device_capacity=10, mem_budget="1MiB", host_in_place=False)
    with pytest.raises(ValueError, match="more than device_capacity = 10"):
        hps.ParameterServer(small_devices).push(np.arange(50, dtype=np.uint64), np.zeros((50, DIM), np.float32))
    ps.checkpoint()
    ps.close()
    with pytest.raises(ValueError, match="holds a parameter server with dim = 4, not 8"):
        hps.ParameterServer(hps.ParameterServerConfig(dim=8, path=cfg.path, seed=11, optimizer=hps.Adam()))
    with pytest.raises(ValueError, match="optimizer.kind = 'adam', not 'sgd'"):
        hps.ParameterServer(config(cfg.path, optimizer=hps.SGD()))
    other = tmp_path / "other"
    other.mkdir()
    (other / "x").write_text("mine")
    with pytest.raises(ValueError, match="is not empty and holds no parameter server"):
        hps.ParameterServer(config(other))
    with pytest.raises(FileNotFoundError, match="holds no parameter server"):
        hps.ParameterServer.open(tmp_path / "nothing")


@pytest.mark.parametrize("field,value,message", [
    ("schedule", "herlad", "schedule must be 'sequential' or 'herald', got 'herlad'"),
    ("lookahead", -1, r"lookahead must be an int >= 0 \(batches\), got -1"),
    ("ttl_steps", -1, r"ttl_steps must be an int >= 0 \(0: off\), got -1"),
    ("cache_policy", "lruu", "cache_policy must be one of lru, .*, got 'lruu'"),
    ("mem_budget", "lots", "mem_budget: cannot read 'lots' as a size"),
    ("devices", 0, "devices must be an int >= 1, got 0"),
    ("device_capacity", 0, r"device_capacity must be an int >= 1 \(rows a device\), got 0"),
    ("write_buffer_rows", -1, "write_buffer_rows must be an int >= 1, got -1"),
    ("device_threads", -1, r"device_threads must be an int >= 0 \(0: all cores\), got -1"),
    ("ssd", hps.SsdOptions(file_records=0), "ssd.file_records must be an int >= 1, got 0"),
    ("ssd", hps.SsdOptions(compaction_trigger=0.5), "ssd.compaction_trigger must be a number >= 1"),
    ("topology", "no-such-topology.toml", "topology: no-such-topology.toml: cannot read the topology file"),
])
def test_a_refused_setting_is_named_and_leaves_nothing_at_the_path(tmp_path, field, value, message):
    """The config is checked before the server creates its directory: a refused
    run leaves no half-made job for the next run to find and start over."""
    path = tmp_path / "ps"
    with pytest.raises(ValueError, match=message):
        hps.ParameterServer(config(path, **{field: value}))
    assert not path.exists()
    with pytest.raises(ValueError, match="^cfg.toml: " + message):
        config(path, **{field: value}).check("cfg.toml")


def test_config_from_toml(tmp_path):
    toml = tmp_path / "ps.toml"
    toml.write_text(textwrap.dedent(f"""
        dim = 8
        path = "{tmp_path / 'ps'}"
        mem_budget = "64MiB"
        devices = 2
        [optimizer]
        kind = "rowwise_adagrad"
        lr = 0.2
        [initializer]
        kind = "normal"
        std = 0.1
        [ssd]
        file_records = 1024
    """))
    cfg = hps.ParameterServerConfig.from_toml(toml)
    assert cfg.optimizer == hps.RowWiseAdaGrad(lr=0.2) and cfg.initializer == hps.Normal(std=0.1)
    assert cfg.ssd.file_records == 1024 and cfg.devices == 2
    ps = hps.ParameterServer(cfg)
    assert ps.pull(np.array([3], np.uint64)).shape == (1, 8)
    toml.write_text('dim = 8\npath = "x"\n[optimizer]\nkind = "rmsprop"\n')
    with pytest.raises(ValueError, match="optimizer: kind must be one of sgd, adagrad, rowwise_adagrad, adam"):
        hps.ParameterServerConfig.from_toml(toml)
    toml.write_text('dim = 8\npath = "x"\nmem_budjet = "1GiB"\n')
    with pytest.raises(ValueError, match="unknown field.s. mem_budjet"):
        hps.ParameterServerConfig.from_toml(toml)


def test_pulls_from_several_threads(tmp_path):
    cfg = config(tmp_path / "ps", mem_budget=200 * (DIM * 3 + 1) * 4 + 200 * 112)
    ps, ref = hps.ParameterServer(cfg), reference(cfg)
    for keys, grads in random_steps(9, 30, universe=1000):
        ps.push(keys, grads)
        ref.push(keys, grads)
    expected = ref.pull(np.arange(1000, dtype=np.uint64))
    errors = []

    def reader(seed):
        rng = np.random.default_rng(seed)
        for _ in range(100):
            keys = rng.integers(0, 1000, 64).astype(np.uint64)
            if not np.array_equal(ps.pull(keys), expected[keys]):
                errors.append(keys)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("devices", [2, 1])  # 1: a host batch on MEM-PS's rows
def test_a_prefetch_during_a_batch_sees_its_updates_once_loaded(tmp_path, devices):
    """The pipeline's order: prefetch batch i+1 while batch i trains; batch i+1
    enters the device tier after batch i's write-back, with batch i's updates."""
    cfg = config(tmp_path / "ps", devices=devices)
    ps, ref = hps.ParameterServer(cfg), reference(cfg)
    steps = list(random_steps(21, 12))
    pending = ps.prefetch(steps[0][0])
    for i, (keys, grads) in enumerate(steps):
        b = ps.batch(pending)
        if i + 1 < len(steps):
            pending = ps.prefetch(steps[i + 1][0])  # overlaps keys of batch i
        np.testing.assert_array_equal(b.pull(keys), ref.pull(keys), err_msg=f"batch {i}")
        b.push(keys, grads, worker=i % devices)
        b.finish()
        ref.push(keys, grads)
    assert ps.stats()["mem"]["pinned"] == 0
    with pytest.raises(ValueError, match="a Prefetched can be used once"):
        used = ps.prefetch(steps[0][0])
        ps.batch(used).finish()
        ps.batch(used)


def batch_alongside(ps, prefetched, in_flight):
    """ps.batch(prefetched, overlap=True) while `in_flight` is not written back
    (applied, so the new batch may read its rows): made in a thread, so that a
    batch that waits for that write-back, which only this thread would do, fails
    the test instead of hanging it."""
    made = []
    thread = threading.Thread(target=lambda: made.append(ps.batch(prefetched, overlap=True)), daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():
        in_flight.write_back()
        thread.join()
        if made:
            made[0].abort()
        raise AssertionError("batch(overlap=True) waited for the write-back of the batch in flight")
    return made[0]


@pytest.mark.parametrize("devices,in_place", [(1, False), (2, False), (1, True)])
def test_an_overlapped_batch_after_one_made_without_overlap_waits_for_no_write_back(tmp_path, devices, in_place):
    """A batch made with overlap loads while the batch in flight, made without
    it, is not yet written back. The second device tier is made then, and the
    new batch took the first, which the batch in flight held: it waited for its
    write-back, in one thread forever."""
    cfg = config(tmp_path / "ps", devices=devices, host_in_place=in_place)
    ps, ref = hps.ParameterServer(cfg), reference(cfg)
    (k1, g1), (k2, g2) = random_steps(31, 2, universe=20)
    first = ps.batch(ps.prefetch(k1))  # without overlap: the server's one device tier
    first.push(k1, g1)
    first.apply()
    ref.push(k1, g1)
    second = batch_alongside(ps, ps.prefetch(k2), first)
    np.testing.assert_array_equal(second.pull(k2), ref.pull(k2))
    second.push(k2, g2)
    first.write_back()
    second.finish()
    ref.push(k2, g2)
    every = np.arange(20, dtype=np.uint64)
    np.testing.assert_array_equal(ps.pull(every), ref.pull(every))
    assert ps.stats()["mem"]["pinned"] == 0
    ps.close()


@pytest.mark.parametrize("devices", [2, 1])
def test_an_overlapped_batch_takes_the_updates_of_the_one_before(tmp_path, devices):
    """The pipeline's order with two device tiers: batch i+1 is loaded while batch i
    trains (its rows read from MEM-PS before batch i's updates), and batch i is
    written back while batch i+1 trains. Every pull still sees every earlier update.
    (One device: both batches work on the same MEM-PS rows, the later after the
    earlier's apply.)"""
    cfg = config(tmp_path / "ps", devices=devices)
    ps, ref = hps.ParameterServer(cfg), reference(cfg)
    steps = list(random_steps(23, 14, universe=60))  # consecutive batches share many keys
    current = ps.batch(ps.prefetch(steps[0][0]), overlap=True)
    for i, (keys, grads) in enumerate(steps):
        nxt = ps.batch(ps.prefetch(steps[i + 1][0]), overlap=True) if i + 1 < len(steps) else None
        np.testing.assert_array_equal(current.pull(keys), ref.pull(keys), err_msg=f"batch {i}")
        current.push(keys, grads, worker=i % devices)
        current.apply()
        ref.push(keys, grads)
        if i % 3 == 0:  # sometimes the write-back lags behind the next batch's first pull
            lagging = current
        else:
            current.write_back()
            lagging = None
        if nxt is not None:
            k = steps[i + 1][0]
            np.testing.assert_array_equal(nxt.pull(k), ref.pull(k), err_msg=f"batch {i + 1}, first pull")
        if lagging is not None:
            lagging.write_back()
        current = nxt
    assert ps.stats()["mem"]["pinned"] == 0
    every = np.arange(60, dtype=np.uint64)
    np.testing.assert_array_equal(ps.pull(every), ref.pull(every))
    ps.checkpoint()
    ps.close()


def test_a_host_batch_trains_the_pinned_rows_in_place(tmp_path):
    cfg = config(tmp_path / "ps", optimizer=hps.AdaGrad(lr=0.1))
    ps, ref = hps.ParameterServer(cfg), reference(cfg)
    keys = np.array([[5, 9, 5], [7, 9, 3]], np.uint64)
    pre = ps.prefetch(keys)
    b = ps.batch(pre)
    assert isinstance(b, hps.HostBatch)
    at = b.positions(keys)
    assert at is pre.inverse  # the prefetch's own keys: no second lookup
    np.testing.assert_array_equal(b.keys[at], keys.ravel())
    # The same keys as hps.torch hands them (an int64 view), or a copy: the same answer.
    assert b.positions(keys.view(np.int64)) is pre.inverse
    assert b.positions(keys.copy()) is pre.inverse
    other = np.array([3, 5, 5], np.uint64)
    np.testing.assert_array_equal(b.keys[b.positions(other)], other)
    # As many keys as the prefetch's, but others: looked up, not taken for them.
    swapped = np.array([[9, 5, 5], [7, 3, 9]], np.uint64)
    np.testing.assert_array_equal(b.keys[b.positions(swapped)], swapped.ravel())
    np.testing.assert_array_equal(b.gather(at), ref.pull(keys.ravel()))
    # Straight into the first columns of a model's input (2 examples, 3 fields, 2 dense).
    x = np.full((2, 3 * DIM + 2), -1.0, np.float32)
    assert b.gather(at, x[:, :3 * DIM]) is not None
    np.testing.assert_array_equal(x[:, :3 * DIM].reshape(6, DIM), ref.pull(keys.ravel()))
    assert (x[:, 3 * DIM:] == -1.0).all()
    with pytest.raises(ValueError, match=r"out must hold 6 rows of 4 float32: .* got shape \(2, 10\)"):
        b.gather(at, x[:, :10])
    with pytest.raises(TypeError, match="out must be an array of float32"):
        b.gather(at, np.zeros((6, DIM)))
    read_only = np.zeros((6, DIM), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writeable"):
        b.gather(at, read_only)
    grads = np.arange(6 * DIM, dtype=np.float32).reshape(6, DIM) / 7
    # The gradient of that input: its first columns hold the fields' gradients.
    grad_x = np.full((2, 3 * DIM + 2), 1e6, np.float32)
    grad_x[:, :3 * DIM] = grads.reshape(2, 3 * DIM)
    b.accumulate(at, grad_x[:, :3 * DIM])
    with pytest.raises(ValueError, match="grads must hold 6 rows"):
        b.accumulate(at, grad_x)
    with pytest.raises(IndexError, match="keys\\[0\\] = 4 is not in the batch"):
        b.pull(np.array([4], np.uint64))
    with pytest.raises(ValueError, match="worker 1: a host batch has one device"):
        b.push(other, np.zeros((3, DIM), np.float32), worker=1)
    b.finish()
    ref.push(keys.ravel(), grads)
    np.testing.assert_array_equal(ps.pull(np.unique(keys)), ref.pull(np.unique(keys)))
    s = ps.stats()
    assert s["mem"]["pinned"] == 0 and s["mem"]["dirty"] == 4  # the updated rows, to store on eviction


def test_an_overlapped_host_batch_reads_only_after_the_one_before_applies(tmp_path):
    cfg = config(tmp_path / "ps", optimizer=hps.SGD(lr=1.0))
    ps = hps.ParameterServer(cfg)
    keys = np.array([1, 2, 3], np.uint64)
    first = ps.batch(ps.prefetch(keys), overlap=True)
    second = ps.batch(ps.prefetch(keys[1:]), overlap=True)
    before = first.pull(keys)
    first.push(keys, np.ones((3, DIM), np.float32))
    seen = []
    reader = threading.Thread(target=lambda: seen.append(second.pull(keys[1:])))
    reader.start()
    reader.join(timeout=0.3)
    assert reader.is_alive() and not seen  # waits for first's step
    first.apply()
    reader.join(timeout=10)
    np.testing.assert_array_equal(seen[0], before[1:] - 1.0)
    # A third overlapped batch waits for a turn: at most two in flight.
    third = []
    maker = threading.Thread(target=lambda: third.append(ps.batch(ps.prefetch(keys), overlap=True)))
    maker.start()
    maker.join(timeout=0.3)
    assert maker.is_alive() and not third
    first.write_back()
    maker.join(timeout=10)
    assert third
    second.finish()
    third[0].abort()
    assert ps.stats()["mem"]["pinned"] == 0


def test_a_dropped_server_is_freed_with_its_files(tmp_path):
    """The native cache holds the server's loader and sink; they must not keep
    the server (its SSD-PS descriptors and compaction thread) alive."""
    import gc
    import weakref

    ps = hps.ParameterServer(config(tmp_path / "ps"))
    ps.push(np.arange(50, dtype=np.uint64), np.ones((50, DIM), np.float32))
    ps.checkpoint()
    gone = weakref.ref(ps)
    del ps
    gc.collect()
    assert gone() is None


def test_the_write_buffer_serves_the_latest_copy_of_each_key(tmp_path):
    """The backing store against a dict: many sink calls, keys evicted again and again
    (within one call too), puts to SSD-PS when the buffer fills, and loads of keys in
    the buffer, on SSD-PS and nowhere (their initial rows)."""
    from hps.optim import native_optimizer
    opt = native_optimizer(2, hps.SGD(lr=0.1), hps.Uniform(0.5), seed=4)
    ssd = hps.SsdStore(tmp_path / "ssd", row_bytes=8, file_records=64)
    backing = hps._core.BackingStore(ssd, opt, write_buffer_rows=50)
    latest = {}
    rng = np.random.default_rng(3)
    for call in range(40):
        keys = rng.integers(1, 200, rng.integers(1, 30)).astype(np.uint64)
        rows = np.stack([keys.astype(np.float32), np.full(len(keys), call, np.float32)], axis=1)
        rows[:, 0] += np.arange(len(keys), dtype=np.float32) / 100  # tells copies within a call apart
        backing.sink(keys, rows)
        for k, r in zip(keys.tolist(), rows):
            latest[k] = r
        probe = np.unique(rng.integers(1, 250, 60)).astype(np.uint64)
        want = np.array([latest[k] if k in latest else opt.initial_rows(np.array([k], np.uint64))[0]
                         for k in probe.tolist()], np.float32)
        np.testing.assert_array_equal(backing.load(probe).view(np.float32), want, err_msg=f"after call {call}")
    c = backing.counts()
    assert c["puts"] >= 5 and c["rows_put"] >= 250 and 0 < c["pending_rows"] < 50, c
    assert c["pending_hits"] > 0 and c["ssd_hits"] > 0 and c["initialized"] > 0, c
    assert c["pending_hits"] + c["ssd_hits"] + c["initialized"] == c["rows_loaded"], c
    backing.flush()
    assert backing.counts()["pending_rows"] == 0 and len(ssd) == len(latest)
    rows, found = ssd.get(np.array(sorted(latest), np.uint64), np.float32)
    assert found.all()
    np.testing.assert_array_equal(rows, np.array([latest[k] for k in sorted(latest)]))


def test_the_backing_store_refuses_what_does_not_fit(tmp_path):
    from hps.optim import native_optimizer
    opt = native_optimizer(2, hps.SGD(lr=0.1), hps.Uniform(0.5), seed=4)  # rows of 8 bytes
    with pytest.raises(ValueError, match="the SSD-PS rows are 16 bytes, the optimizer's 8"):
        hps._core.BackingStore(hps.SsdStore(tmp_path / "a", row_bytes=16), opt, write_buffer_rows=8)
    backing = hps._core.BackingStore(hps.SsdStore(tmp_path / "b", row_bytes=8), opt, write_buffer_rows=8)
    with pytest.raises(ValueError, match="write_buffer_rows must be in \\[1, 2\\^31\\], got 0"):
        hps._core.BackingStore(hps.SsdStore(tmp_path / "c", row_bytes=8), opt, write_buffer_rows=0)
    with pytest.raises(ValueError, match="loader: a BackingStore of 8-byte rows for a cache of 16-byte rows"):
        hps.MemCache(16, capacity=4, loader=backing)
    with pytest.raises(ValueError, match="rows"):
        backing.sink(np.array([1, 2], np.uint64), np.zeros((2, 3), np.float32))


@pytest.mark.parametrize("devices", [1, 2])
def test_arrays_that_went_through_pickle_are_taken(tmp_path, devices):
    """An array sent to a worker process (multiprocessing, a DataLoader) comes back
    with a dtype equal to numpy's uint64 but not the same object; the bindings once
    refused it as "uint64, got uint64"."""
    import pickle
    ps = hps.ParameterServer(hps.ParameterServerConfig(dim=4, path=str(tmp_path), optimizer=hps.SGD(lr=1.0),
                                                       devices=devices))
    keys = np.arange(1, 10, dtype=np.uint64)
    sent = pickle.loads(pickle.dumps(keys))
    assert sent.dtype == keys.dtype and sent.dtype is not keys.dtype  # what makes the case
    before = ps.pull(keys)
    np.testing.assert_array_equal(ps.pull(sent), before)
    ps.push(sent, pickle.loads(pickle.dumps(np.ones((9, 4), np.float32))))
    np.testing.assert_allclose(ps.pull(keys), before - 1.0)
    with pytest.raises(TypeError, match=r"uint64 or int64, got >u8"):
        ps.pull(keys.astype(">u8"))  # another byte order is still refused, by name
    ps.close()


def test_a_closed_server_says_so(tmp_path):
    """After close() a call named the store it had dropped (AttributeError: '_cache');
    it now says the server is closed, and closing again does nothing."""
    ps = hps.ParameterServer(config(tmp_path / "ps"))
    keys = np.arange(4, dtype=np.uint64)
    ps.push(keys, np.ones((4, ps.dim), np.float32))
    ps.checkpoint()
    ps.close()
    ps.close()
    for call in (lambda: ps.pull(keys), lambda: ps.checkpoint(), lambda: ps.stats()):
        with pytest.raises(RuntimeError, match=r"ParameterServer\(dim=.*\) is closed"):
            call()
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        hps.ParameterServer(config(tmp_path / "ps")).no_such_thing  # (the path was released: it opens again)


HANG = 60  # seconds: a call still running by then waits for good


def finishes(call, timeout=HANG):
    """call() on a thread of its own: ("returned", its value) or ("raised", its
    error); an AssertionError where it still runs after `timeout` seconds (a hang
    guard: the suite goes on, the thread is left waiting)."""
    done = []

    def run():
        try:
            done.append(("returned", call()))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            done.append(("raised", e))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the call still waits for a batch that waits for this thread"
    return done[0]


# The server's kinds of batch: on MEM-PS's rows, on a device tier, on Herald's worker caches.
BATCH_KINDS = {"in-place": ("HostBatch", dict(host_in_place=True)), "tier": ("Batch", dict(host_in_place=False)),
               "herald": ("HeraldBatch", dict(schedule="herald"))}


@pytest.mark.parametrize("kind,call", [(k, c) for k in BATCH_KINDS for c in ("push", "batch", "checkpoint")
                                       if (k, c) != ("herald", "batch")])  # (a Herald batch waits for none)
def test_a_call_that_waits_for_a_batch_whose_with_block_this_thread_is_in_is_refused_naming_it(tmp_path, kind,
                                                                                                 call):
    """push, batch (without overlap) and checkpoint wait for the batches in flight
    to be written back; one whose with block this thread is in is written back
    when the thread leaves the block, so each waited forever, in one thread. Each
    is refused at once, naming the call, the batch and what to do, and leaves
    nothing behind: the batch goes on and takes its step, and the call goes ahead
    once the block is left. (A Herald push in the block started its batch out of
    order, was refused, and its abort stopped the caches for good; a Herald batch
    waits for none.)"""
    name, options = BATCH_KINDS[kind]
    ps = hps.ParameterServer(config(tmp_path / "ps", optimizer=hps.SGD(lr=0.5), **options))
    keys = np.array([1, 2, 3], np.uint64)
    ones = np.ones((3, DIM), np.float32)
    before = ps.pull(keys)
    calls = {"push": lambda: ps.push(keys, ones), "batch": lambda: ps.batch(keys).finish(), "checkpoint": ps.checkpoint}

    def in_the_block():
        with ps.batch(keys) as b:
            try:
                calls[call]()
            except RuntimeError as e:
                refused = e
            else:
                refused = None
            b.push(keys, ones)
        return refused
    outcome, refused = finishes(in_the_block)
    assert outcome == "returned" and isinstance(refused, RuntimeError), (outcome, refused)
    said = str(refused)
    assert said.startswith(f"ParameterServer.{call} "), said
    assert f"the {name} of 3 keys made by batch() is open on this thread, in its with block (not yet applied)" \
        in said, said
    fix = {"push": "Push the gradients into that batch (batch.push(keys, grads)",
           "batch": "Nothing was made. Finish that batch first (leave its with block)",
           "checkpoint": "Nothing was written. Checkpoint once that batch is finished (after its with block)"}[call]
    assert fix in said, said
    np.testing.assert_allclose(ps.pull(keys), before - 0.5, rtol=1e-6)  # the batch's step alone
    if call == "checkpoint":
        assert ps.checkpoint() == 1  # the refused one wrote none
    else:
        calls[call]()
        if call == "push":
            np.testing.assert_allclose(ps.pull(keys), before - 1.0, rtol=1e-6)
    assert ps.stats()["mem"]["pinned"] == 0
    ps.close()


@pytest.mark.parametrize("kind", ["in-place", "tier"])
def test_an_overlapped_batch_that_waits_for_batches_this_thread_holds_is_refused_naming_them(tmp_path, kind):
    """batch(overlap=True) waits for one of the two batches in flight (in place),
    or for the device tier it takes next, the two taking turns: held by batches
    whose with blocks this thread is in, it waited forever. Refused at once,
    making nothing (its prefetch let go); beside one such batch, with the other
    tier or turn free, it is made as ever."""
    name, options = BATCH_KINDS[kind]
    ps = hps.ParameterServer(config(tmp_path / "ps", optimizer=hps.SGD(lr=0.5), **options))
    keys = np.array([1, 2, 3], np.uint64)

    def in_the_blocks():
        with ps.batch(keys, overlap=True):
            if kind == "in-place":
                try:
                    with ps.batch(keys[:2], overlap=True):  # beside the one in flight: made
                        ps.batch(keys, overlap=True)
                except RuntimeError as e:  # (which aborts the inner block's batch: its step would wait for
                    return e               # the outer's, applied when this thread leaves that block)
            else:
                ps.batch(keys[:2], overlap=True).abort()  # the other tier: made (then free again)
                try:
                    ps.batch(keys, overlap=True)  # the tier this block's batch holds: its turn
                except RuntimeError as e:
                    return e
    outcome, refused = finishes(in_the_blocks)
    assert outcome == "returned" and isinstance(refused, RuntimeError), (outcome, refused)
    said = str(refused)
    waits = {"in-place": "waits for one of the two batches in flight to be written back (at most two are)",
             "tier": "waits for the device tier it takes next (the two tiers take turns) to be free"}[kind]
    assert said.startswith(f"ParameterServer.batch(overlap=True) {waits}, and the {name} of "), said
    assert "is open on this thread, in its with block (not yet applied" in said, said
    assert "Nothing was made." in said, said
    assert ps.stats()["mem"]["pinned"] == 0
    ps.batch(keys, overlap=True).finish()  # (the blocks left: it goes ahead)
    ps.close()


@pytest.mark.parametrize("kind", ["in-place", "tier"])
@pytest.mark.parametrize("call", ["push", "batch", "checkpoint"])
def test_a_call_waits_for_a_batch_another_thread_holds_and_goes_ahead_once_it_is_written_back(tmp_path, kind,
                                                                                              call):
    """A batch whose with block another thread is in is written back when that
    thread goes on: this thread's push, batch or checkpoint waits for it (not
    refused), then goes ahead."""
    ps = hps.ParameterServer(config(tmp_path / "ps", optimizer=hps.SGD(lr=0.5), **BATCH_KINDS[kind][1]))
    keys = np.array([1, 2, 3], np.uint64)
    ones = np.ones((3, DIM), np.float32)
    before = ps.pull(keys)
    made, go = threading.Event(), threading.Event()

    def other():
        with ps.batch(keys) as b:
            made.set()
            go.wait(HANG)
            b.push(keys, ones)
    holder = threading.Thread(target=other, daemon=True)
    holder.start()
    assert made.wait(HANG)
    calls = {"push": lambda: ps.push(keys, ones), "batch": lambda: ps.batch(keys).finish(), "checkpoint": ps.checkpoint}
    done = []
    waiting = threading.Thread(target=lambda: done.append(finishes(calls[call])), daemon=True)
    waiting.start()
    waiting.join(0.3)  # (time to reach its wait: if it returned or raised meanwhile, the asserts below say so)
    go.set()
    holder.join(HANG)
    waiting.join(HANG)
    assert not holder.is_alive() and not waiting.is_alive()
    assert done[0][0] == "returned", done
    np.testing.assert_allclose(ps.pull(keys), before - (1.0 if call == "push" else 0.5), rtol=1e-6)
    ps.close()
