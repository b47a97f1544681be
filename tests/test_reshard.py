"""Reshard on restore (hps.reshard): a job checkpointed on N ranks resumes under
``mpiexec -n M`` (tests/mpi_scenarios.py runs the ranks). Checked: after the
reshard every key's whole row (embedding and optimizer state) is the old
checkpoint's, on its owner under M; training on from it equals an M-rank job
resumed from the same state; a crash before the switch leaves the old job
resumable; a missing part of the checkpoint is named."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

pytest.importorskip("mpi4py", reason="hps.distributed needs mpi4py (pip install '.[mpi]')")
pytest.importorskip("torch")
import mpi_scenarios as sc  # noqa: E402 (tests/ is on pytest's sys.path; after the skips)
from mpi_scenarios import MPIEXEC  # noqa: E402
from table_helpers import rows_of  # noqa: E402

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")

STEPS, PER_RANK, EVERY = 4, 32, 2


def scenario(n: int, out, *args, check: bool = True) -> subprocess.CompletedProcess:
    return sc.scenario(n, "train", out, "--per-rank", PER_RANK, "--checkpoint-every", EVERY, *args, check=check)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """A job of 2 ranks checkpointed at step STEPS, made once (tests copy it)."""
    return old_job(tmp_path_factory.mktemp("two_ranks"), 2)


@pytest.fixture(scope="module")
def two_ranks_kstep(tmp_path_factory):
    """A k-step Adam job (k = 3) of 2 ranks checkpointed at step STEPS, made once (tests copy it)."""
    return old_job(tmp_path_factory.mktemp("two_ranks_kstep"), 2, sync="kstep")


@pytest.fixture(scope="module")
def two_ranks_admission(tmp_path_factory):
    """A job of 2 ranks with [admission] threshold = 3 checkpointed at step STEPS, made
    once (tests copy it)."""
    out = tmp_path_factory.mktemp("two_ranks_admission") / "old"
    scenario(2, out, "--steps", STEPS, "--admission", 3)
    return out


def copy_of(job, tmp_path):
    shutil.copytree(job, tmp_path / "old")
    return tmp_path / "old"


def old_job(tmp_path, world: int, sync: str = "allreduce"):
    """A job of `world` ranks checkpointed at step STEPS; world 1: one process (no mpiexec)."""
    out = tmp_path / "old"
    if world == 1:
        from hps.train import train
        cfg = sc.train_config(str(out / "job"))
        cfg.checkpoint_every = EVERY
        train(cfg, progress=False, train_batches=sc.global_batches(STEPS, PER_RANK, 1), eval_batches=[])
    else:
        scenario(world, out, "--steps", STEPS, "--dense-sync", sync, "--k", 3)
    return out




def dense_states(root, world: int) -> list:
    """Every rank's dense state in the checkpoint job.json names."""
    import torch
    from hps.jobdir import read_job
    job = read_job(str(root))
    assert job.world == world
    return [torch.load(os.path.join(job.checkpoint_dir(r), "trainer-state.pt"), weights_only=False)
            for r in range(world)]


def reshard_in_process(root, world: int) -> None:
    """The reshard's steps, every new rank's in turn, under rank 0's Hold (what
    _prepare_job runs on each rank)."""
    from hps import reshard
    with reshard.Hold(str(root)) as hold:
        old = reshard.check_source(str(root), hold)
        reshard.take_new_ranks(str(root), world, hold)
        done = [reshard.write_rank(str(root), world, r, held=True) for r in range(world)]
        reshard.commit(str(root), world, old, done[0][1], hold)


def assert_same_job(a, b, world: int) -> None:
    import torch
    ra, rb = rows_of(a), rows_of(b)
    assert ra.keys() == rb.keys()
    for k in ra:
        assert ra[k] == rb[k], k
    for sa, sb in zip(dense_states(a, world), dense_states(b, world)):
        assert sa["batches_done"] == sb["batches_done"]
        for name, value in sa["mlp"].items():
            assert torch.equal(sb["mlp"][name], value), name


@pytest.mark.parametrize("old_world,new_world", [(2, 3), (4, 2), (1, 2)])
def test_reshard_moves_every_row_to_its_owner_and_trains_on_as_an_m_rank_job(tmp_path, two_ranks, old_world,
                                                                              new_world):
    from hps.distributed import owner_ranks
    old = copy_of(two_ranks, tmp_path) if old_world == 2 else old_job(tmp_path, old_world)
    before = rows_of(old / "job")
    before_dense = load_old_dense(old / "job", old_world)
    for name in ("via_train", "reference"):
        shutil.copytree(old, tmp_path / name)

    # The reference: resharded by the steps themselves, then the rows checked against the old checkpoint.
    ref = tmp_path / "reference"
    from hps.jobdir import read_job
    old_run = read_job(str(ref / "job")).run
    reshard_in_process(ref / "job", new_world)
    after = rows_of(ref / "job")
    assert after.keys() == before.keys() and len(after) > 100
    keys = np.array(sorted(after), np.uint64)
    owners = owner_ranks(keys, new_world)
    assert len({stamp for _, _, stamp in before.values()}) > 1  # rows last updated at different steps
    for k, owner in zip(keys.tolist(), owners.tolist()):
        # On its owner, the whole row (optimizer state too) and the step of its last update as before.
        assert after[k] == (owner, before[k][1], before[k][2]), k
    assert set(owners.tolist()) == set(range(new_world))
    job = json.loads((ref / "job" / "job.json").read_text())
    # its files are numbered anew: a new run, so that no export position of the old one applies
    assert job.pop("run") not in (None, old_run)
    assert job == {"world": new_world, "step": STEPS, "checkpoint": job["checkpoint"],
                   "resharded_from": {"world": old_world, "checkpoint": job["checkpoint"] - 1}}
    assert sorted(n for n in os.listdir(ref / "job") if n.startswith("rank")) == \
        [f"rank{r}" for r in range(new_world)]
    assert not os.path.exists(ref / "job" / "hps-parameter-server.json")  # a one-process job's, gone
    from hps.jobdir import inspect
    report = inspect(str(ref / "job"), verify=True)
    assert (report["world"], report["rows"], report["step"]) == (new_world, len(before), STEPS)
    assert report["verify"]["ok"], report["verify"]["problems"]
    # Each new checkpoint records its MANIFEST as checkpoint() does (ssd.json), so a copy cut
    # at a record boundary is refused there too.
    for r in range(new_world):
        checkpoint = ref / "job" / f"rank{r}" / "checkpoints" / f"{job['checkpoint']:06d}"
        digest = json.loads((checkpoint / "ssd.json").read_text())
        assert digest["manifest_bytes"] == (checkpoint / "ssd" / "MANIFEST").stat().st_size > 0
    import torch
    for state in dense_states(ref / "job", new_world):
        assert state["batches_done"] == STEPS
        for name, value in before_dense[0]["mlp"].items():
            assert torch.equal(state["mlp"][name], value), name

    # Trained on, on M ranks: resumed after the reshard there, and resharded by hps train here.
    scenario(new_world, ref, "--steps", STEPS + 4, "--resume")
    p = scenario(new_world, tmp_path / "via_train", "--steps", STEPS + 4, "--resume")
    assert f"ran on {old_world} rank(s), this run has {new_world}: resharding its checkpoint" in p.stderr
    assert_same_job(tmp_path / "via_train" / "job", ref / "job", new_world)
    assert rows_of(ref / "job") != after  # it trained


def load_old_dense(root, world: int) -> list:
    if not os.path.exists(os.path.join(root, "job.json")):
        from hps.train import load_trainer_state
        return [load_trainer_state(str(root))]
    return dense_states(root, world)


def test_kstep_dense_state_is_averaged_over_the_old_ranks(tmp_path, two_ranks_kstep):
    """k-step Adam keeps m per rank (k = 3; the job's last checkpoint follows its
    final merge, so x and v agree): each new rank starts from the old ranks'
    mean m, and x and v as they were."""
    import torch
    old = copy_of(two_ranks_kstep, tmp_path)
    states = dense_states(old / "job", 2)
    ms = [s["opt"]["state"][0]["m"] for s in states]
    assert not torch.equal(ms[0], ms[1])
    reshard_in_process(old / "job", 3)
    for state in dense_states(old / "job", 3):
        for n, value in state["mlp"].items():
            torch.testing.assert_close(value, (states[0]["mlp"][n] + states[1]["mlp"][n]) / 2, rtol=0, atol=1e-7)
        for i, st in state["opt"]["state"].items():
            for moment in ("m", "v"):
                want = (states[0]["opt"]["state"][i][moment] + states[1]["opt"]["state"][i][moment]) / 2
                torch.testing.assert_close(st[moment], want, rtol=0, atol=1e-7)
        assert state["dense_sync"] == states[0]["dense_sync"]
    assert json.loads((old / "job" / "job.json").read_text())["world"] == 3


def test_a_reshard_cut_short_before_the_switch_leaves_the_old_job_resumable(tmp_path, two_ranks):
    """Two of three new ranks wrote their share (rank 2's directory is new, rank
    1's holds an extra checkpoint), then the job died: job.json still names the
    old checkpoint of 2 ranks, which resumes on 2 ranks to exactly what an
    untouched copy does; resharding again later works too."""
    from hps import reshard
    old = copy_of(two_ranks, tmp_path)
    shutil.copytree(old, tmp_path / "untouched")
    reshard.check_source(str(old / "job"))
    reshard.write_rank(str(old / "job"), 3, 2)
    reshard.write_rank(str(old / "job"), 3, 1)
    assert json.loads((old / "job" / "job.json").read_text())["world"] == 2
    assert rows_of(old / "job") == rows_of(tmp_path / "untouched" / "job")
    for d in (old, tmp_path / "untouched"):
        scenario(2, d, "--steps", STEPS + 2, "--resume")
    assert_same_job(old / "job", tmp_path / "untouched" / "job", 2)

    # And again, on 3 ranks now (the old rank 2 directory of the cut reshard is replaced).
    p = scenario(3, old, "--steps", STEPS + 2, "--resume")
    assert "resharding its checkpoint" in p.stderr
    # Resharded, and its data was done: every rank says the job is finished at step 6.
    for r in range(3):
        assert json.loads((old / f"rank{r}.json").read_text())["finished_before"]["batches"] == STEPS + 2


@pytest.mark.parametrize("old_world,new_world", [(1, 2), (2, 3), (2, 1)])
def test_what_the_switch_names_survives_a_power_loss(tmp_path, two_ranks, monkeypatch, old_world, new_world):
    """Every directory entry of the resharded job is synced before the switch (the
    rename of job.json, or of it to resharded-from.json), which may reach the disk
    before any sync and is followed by the removal of the old job's files. A new
    rank's metadata and checkpoints/ were never synced in its directory: a power
    loss after the reshard could leave the job naming a checkpoint that the rank
    lost, and the old job's files removed. The page cache hides this from any
    reopen, so the calls are logged (tests/durable_names.py)."""
    from durable_names import NameLog
    from hps import reshard
    old = copy_of(two_ranks, tmp_path) if old_world == 2 else old_job(tmp_path, old_world)
    root = old / "job"
    log = NameLog(monkeypatch)
    if new_world == 1:
        reshard.to_one_process(str(root))
        switch = root / "resharded-from.json"
    else:
        reshard_in_process(root, new_world)
        switch = root / "job.json"
    assert log.unsynced(root, before=log.index_of_entry(switch)) == []
    assert log.unsynced(root) == []


@pytest.mark.parametrize("missing", ["parameter file", "dense state", "checkpoint"])
def test_an_incomplete_checkpoint_is_named_and_nothing_is_written(tmp_path, two_ranks, missing):
    from hps import reshard
    from hps.jobdir import read_job
    old = copy_of(two_ranks, tmp_path)
    job = read_job(str(old / "job"))
    directory = job.checkpoint_dir(1)
    if missing == "parameter file":
        path = sorted(os.path.join(directory, "ssd", n) for n in os.listdir(os.path.join(directory, "ssd"))
                      if n.endswith(".hpf"))[0]
        os.remove(path)
    elif missing == "dense state":
        path = os.path.join(directory, "trainer-state.pt")
        os.remove(path)
    else:
        path = directory
        shutil.rmtree(path)
    with pytest.raises(FileNotFoundError, match=f"rank 1 of the job at .*: {path} is missing"):
        reshard.check_source(str(old / "job"))
    if missing != "parameter file":
        return  # (hps train's path below is the same check's)
    listing = sorted(os.listdir(old / "job"))
    p = scenario(3, old, "--steps", STEPS, "--resume", check=False)
    assert p.returncode != 0 and f"{path} is missing" in p.stderr, p.stderr[-3000:]
    assert sorted(os.listdir(old / "job")) == listing  # no rank2, job.json as it was
    assert json.loads((old / "job" / "job.json").read_text())["world"] == 2


@pytest.mark.parametrize("old_world", [2, 1])
def test_a_job_still_running_is_not_resharded_under_it(tmp_path, two_ranks, old_world):
    """A resume on another number of ranks started while a server of the old job is
    open (the job still runs) is refused, naming it, before anything is written:
    else that job's next checkpoint would replace the one the reshard wrote, and the
    switch would take the job from under it."""
    import hps
    from hps import reshard
    old = copy_of(two_ranks, tmp_path) if old_world == 2 else old_job(tmp_path, 1)
    server = old / "job" / "rank1" if old_world == 2 else old / "job"
    held = hps.ParameterServer.open(server)
    try:
        listing = sorted(os.listdir(old / "job"))
        where = "rank 1 of the job" if old_world == 2 else "the parameter server"
        with pytest.raises(hps.PathInUseError, match=f"{where} at .*still running.*{server}: another parameter "
                                                     f"server has this path open"):
            reshard.check_source(str(old / "job"))
        if old_world == 2:  # hps train names it on every rank
            p = scenario(3, old, "--steps", STEPS, "--resume", check=False)
            assert p.returncode != 0 and "still running" in p.stderr, p.stderr[-3000:]
        assert sorted(os.listdir(old / "job")) == listing
    finally:
        held.close()
    reshard_in_process(old / "job", 3)  # once it is closed
    assert json.loads((old / "job" / "job.json").read_text())["world"] == 3


class _OneRank:
    """A stand-in for hps.distributed.Node of one rank: _prepare_job in this process."""

    rank, size = 0, 1

    def allgather(self, channel, value, what, note=None):
        return [value]


def _refused(path, root) -> str:
    """What opening a server at `path` (as a run of the job would) says while this
    process reshards the job at `root`: "" when it opens."""
    import hps
    try:
        hps.ParameterServer.open(path).close()
    except hps.PathInUseError as e:
        assert f"pid {os.getpid()} on " in str(e) and f"resharding the job at {root}" in str(e), str(e)
        return str(e)
    return ""


@pytest.mark.parametrize("how", ["ranks", "one process"])
def test_a_run_started_during_the_reshard_is_refused_naming_it(tmp_path, two_ranks, monkeypatch, how):
    """The reshard holds the old job's directories from its check to its end: a run
    of the old job started while it writes (here: an mpiexec -n 2 hps train
    --resume, and a server opened in this process) is refused with
    hps.PathInUseError naming the reshard's process, and the reshard finishes.
    Checked, then let go, that run would train on while its directories were
    rewritten, and the switch would take the job from under it."""
    from hps import reshard
    from hps.train import _prepare_job
    old = copy_of(two_ranks, tmp_path)
    root = str(old / "job")
    seen = {}
    write_rank = reshard.write_rank

    def write_rank_meanwhile(*args, **kw):
        seen["rank1"] = _refused(old / "job" / "rank1", root)
        if how == "ranks":
            p = scenario(2, old, "--steps", STEPS + 2, "--resume", check=False)
            seen["train"] = (p.returncode, p.stderr[-3000:])
        return write_rank(*args, **kw)

    monkeypatch.setattr(reshard, "write_rank", write_rank_meanwhile)
    if how == "ranks":  # (this process as the one rank of the resumed job)
        from hps.jobdir import read_job
        number = read_job(root).checkpoint
        assert _prepare_job(sc.train_config(root), _OneRank(), resume=True) == number + 1
    else:
        remove_old_ranks = reshard.remove_old_ranks

        def remove_old_ranks_meanwhile(path, hold=None):  # after the switch: root is the job now (then hps train's)
            seen.setdefault("root", _refused(old / "job", root))
            return remove_old_ranks(path, hold)

        monkeypatch.setattr(reshard, "remove_old_ranks", remove_old_ranks_meanwhile)
        one_process(old / "job", STEPS + 2, resume=True)
        assert seen["root"]
    assert seen["rank1"]
    if how == "ranks":
        code, err = seen["train"]
        assert code != 0 and "PathInUseError" in err and f"resharding the job at {root}" in err, err
    assert dense_states(old / "job", 1)[0]["batches_done"] == (STEPS if how == "ranks" else STEPS + 2)
    monkeypatch.undo()
    assert not _refused(old / "job" / ("rank0" if how == "ranks" else ""), root)  # let go at the end


def test_a_reshard_holds_the_new_ranks_from_its_switch(tmp_path, two_ranks, monkeypatch):
    """2 -> 3: from the switch on job.json names rank 2, new; a run of the new job
    opening it while the old files are removed is refused until the commit ends."""
    from hps import reshard
    old = copy_of(two_ranks, tmp_path)
    root = str(old / "job")
    seen = []
    remove_old = reshard.remove_old

    def remove_old_meanwhile(path, hold=None):
        seen.append(_refused(old / "job" / "rank2", root))
        return remove_old(path, hold)

    monkeypatch.setattr(reshard, "remove_old", remove_old_meanwhile)
    with reshard.Hold(root) as hold:
        before = reshard.check_source(root, hold)
        done = [reshard.write_rank(root, 3, r) for r in range(3)]
        reshard.commit(root, 3, before, done[0][1], hold)
        assert seen and seen[0]
    assert not _refused(old / "job" / "rank2", root)


def test_the_old_files_a_crash_after_the_switch_left_go_at_the_next_resume(tmp_path, monkeypatch):
    """One process -> 2 ranks, the job dies right after job.json's switch, before
    the one-process parameter server at the root is removed: the next resume on
    2 ranks removes it and trains on from the resharded checkpoint."""
    from hps import reshard
    old = old_job(tmp_path, 1)
    monkeypatch.setattr(reshard, "remove_old", lambda root, hold=None: None)
    reshard_in_process(old / "job", 2)
    monkeypatch.undo()
    assert os.path.exists(old / "job" / "hps-parameter-server.json")
    assert json.loads((old / "job" / "job.json").read_text())["world"] == 2
    p = scenario(2, old, "--steps", STEPS + 2, "--resume")
    assert "resharding" not in p.stderr
    for name in ("hps-parameter-server.json", "ssd", "checkpoints"):
        assert not os.path.exists(old / "job" / name), name
    assert dense_states(old / "job", 2)[0]["batches_done"] == STEPS + 2


def test_the_root_stays_held_while_the_one_process_server_there_is_removed(tmp_path, monkeypatch):
    """One process -> 2 ranks: the commit let go of the root's lock and the removal
    of the old server there took it again; a server opened in between (here as the
    removal starts) made the removal refuse, leaving the old server's files to the
    next run. The root stays held: that open is refused, and the removal finishes."""
    from hps import reshard
    from hps import train as hps_train
    from hps.parameter_server import WRITER_LOCK, PathInUseError, _lock_path
    old = old_job(tmp_path, 1)
    root = str(old / "job")
    refused = []
    discard_run = hps_train._discard_run

    def open_then_discard(path, *args, **kw):
        fd = None
        try:
            fd = _lock_path(path)  # (as a ParameterServer opening there does)
        except PathInUseError as e:
            refused.append(str(e))
        try:
            return discard_run(path, *args, **kw)
        finally:
            if fd is not None:
                os.close(fd)

    monkeypatch.setattr(hps_train, "_discard_run", open_then_discard)
    reshard_in_process(root, 2)
    monkeypatch.undo()
    assert len(refused) == 1 and f"pid {os.getpid()} on " in refused[0] and f"resharding the job at {root}" \
        in refused[0], refused
    for name in ("hps-parameter-server.json", "ssd", "checkpoints", WRITER_LOCK):
        assert not os.path.exists(old / "job" / name), name
    assert json.loads((old / "job" / "job.json").read_text())["world"] == 2
    assert not _refused(old / "job" / "rank0", root)  # let go at the end


def _listing(path) -> list:
    return sorted(os.path.relpath(os.path.join(d, n), path) for d, _, names in os.walk(path) for n in names)


@contextlib.contextmanager
def _a_server_open_on(path):
    """path's writer lock held while the body runs, as a parameter server open there
    holds it; the body done, its files must be as they were. (The directories these
    tests hold are no rank of the job when the body runs, where a ParameterServer
    refuses to open: held since before, by a server opened while it was a rank, or
    by another reshard.)"""
    from hps.parameter_server import _lock_path
    fd = _lock_path(str(path))
    try:
        listing = _listing(path)
        yield
        assert os.path.isdir(path) and _listing(path) == listing
    finally:
        os.close(fd)


def test_the_rank_directories_a_reshard_to_one_process_left_are_not_removed_under_a_server(tmp_path, two_ranks,
                                                                                             monkeypatch):
    """2 -> 1, the job died right after the switch (resharded-from.json written, the
    rank directories still there), and a server holds rank 1's (opened before the
    switch: _a_server_open_on): the next one-process hps train --resume is refused,
    naming the directory, and leaves it whole; once the server is closed the rank
    directories go. Removed without their locks, the server's files went from
    under it."""
    import hps
    from hps import reshard
    old = copy_of(two_ranks, tmp_path)
    root = old / "job"
    monkeypatch.setattr(reshard, "remove_old_ranks", lambda root, hold=None: None)
    reshard.to_one_process(str(root))
    monkeypatch.undo()
    assert os.path.exists(root / reshard.RESHARDED_FILE) and os.path.isdir(root / "rank1")
    with _a_server_open_on(root / "rank1"):
        with pytest.raises(hps.PathInUseError, match=f"rank 1 of the job at {root} before its reshard to one "
                                                     f"process: another run has its directory open; it was not "
                                                     f"removed .*{root / 'rank1'}: another parameter server"):
            one_process(root, STEPS + 2, resume=True)
        assert os.path.exists(root / reshard.RESHARDED_FILE)  # (the next run removes what is left)
    one_process(root, STEPS + 2, resume=True)
    assert not os.path.exists(root / "rank0") and not os.path.exists(root / "rank1")
    assert not os.path.exists(root / reshard.RESHARDED_FILE)
    assert dense_states(root, 1)[0]["batches_done"] == STEPS + 2


@pytest.mark.parametrize("damage, named", [
    (b"{not json", "not JSON"),
    (b"[2, 4]", r"not a job record \(a JSON list, not an object\)"),
    (b'{"checkpoint": 4}', "no field 'world'"),
    (b'{"world": "2", "checkpoint": 4}', "field 'world' must be a number of ranks >= 1, got '2'"),
    (b'{"world": 1.5, "checkpoint": 4}', "field 'world' must be a number of ranks >= 1, got 1.5"),
])
def test_a_damaged_record_of_a_reshard_to_one_process_is_named_and_nothing_is_removed(tmp_path, two_ranks,
                                                                                      monkeypatch, damage, named):
    """2 -> 1, the job died right after the switch, and resharded-from.json (the old
    job.json, which names the rank directories to remove) is damaged: the next
    one-process hps train --resume raises ValueError naming the file and the field,
    and removes nothing. It was read with a bare json.load(...)["world"]: a
    KeyError, TypeError or JSONDecodeError that named no file."""
    from hps import reshard
    old = copy_of(two_ranks, tmp_path)
    root = old / "job"
    monkeypatch.setattr(reshard, "remove_old_ranks", lambda root, hold=None: None)
    reshard.to_one_process(str(root))
    monkeypatch.undo()
    record = root / reshard.RESHARDED_FILE
    record.write_bytes(damage)
    with pytest.raises(ValueError, match=f"^{re.escape(str(record))}: {named}"):
        one_process(root, STEPS + 2, resume=True)
    assert record.read_bytes() == damage
    assert os.path.isdir(root / "rank0") and os.path.isdir(root / "rank1")


def test_a_lookup_of_a_rank_directory_serves_on_when_the_directory_is_removed(tmp_path, two_ranks, monkeypatch):
    """hps serve takes no writer lock (it reads a pinned view: hard links, files held
    open), so the removal of the rank directories does not wait for it: the rows it
    serves stay the checkpoint's, those not read before included. (Opened before the
    reshard: once its switch is made, a rank directory is refused, no rank of a job.)"""
    from hps import reshard
    from hps.jobdir import latest_records, open_store, pin
    from hps.lookup import Lookup
    old = copy_of(two_ranks, tmp_path)
    root = old / "job"
    with pin(str(root / "rank1")) as view:
        keys, _ = latest_records(view.ranks[0])
        store = open_store(view.ranks[0], view.job.row_bytes)
        rows, found = store.get(keys)
        assert found.all()
        del store
    lookup = Lookup(root / "rank1", "64MiB")
    try:
        monkeypatch.setattr(reshard, "remove_old_ranks", lambda root, hold=None: None)
        reshard.to_one_process(str(root))
        monkeypatch.undo()
        with pytest.raises(FileNotFoundError, match="before its reshard to one process"):
            Lookup(root / "rank1", "64MiB")
        half = len(keys) // 2
        assert lookup.lookup(keys[:half])[1].all()
        reshard.remove_old_ranks(str(root))
        assert not os.path.exists(root / "rank1")
        got, found = lookup.lookup(keys[half:])  # (not cached: read from the pinned files)
        assert found.all()
        assert np.array_equal(got, rows[half:].view(np.float32)[:, :got.shape[1]])
    finally:
        lookup.close()


def test_the_rank_directories_a_reshard_to_fewer_ranks_left_are_not_removed_under_a_server(tmp_path, two_ranks,
                                                                                             monkeypatch):
    """2 -> 1 rank under mpiexec, the job died right after job.json's switch (rank 1's
    directory still there), and a server holds it (_a_server_open_on): the next resume (rank 0's
    _prepare_job) is refused, naming it, and leaves it whole; once closed, it goes."""
    from hps import reshard
    from hps.train import _prepare_job
    old = copy_of(two_ranks, tmp_path)
    root = old / "job"
    monkeypatch.setattr(reshard, "remove_old", lambda root, hold=None: None)
    reshard_in_process(root, 1)
    monkeypatch.undo()
    assert json.loads((root / "job.json").read_text())["world"] == 1 and os.path.isdir(root / "rank1")
    with _a_server_open_on(root / "rank1"):
        with pytest.raises(ValueError, match=f"rank 1 of the job at {root} before its reshard to 1 ranks: "
                                             f"another run has its directory open; it was not removed"):
            _prepare_job(sc.train_config(str(root)), _OneRank(), resume=True)
    number = json.loads((root / "job.json").read_text())["checkpoint"]
    assert _prepare_job(sc.train_config(str(root)), _OneRank(), resume=True) == number
    assert not os.path.exists(root / "rank1")


def test_a_server_opened_as_a_rank_directory_is_removed_is_named(tmp_path, monkeypatch):
    """A server that opens a rank directory once its removal unlinked the lock file
    (it makes a new one) keeps the directory: the removal is refused naming it."""
    import hps
    from hps import reshard
    from hps.parameter_server import WRITER_LOCK, _lock_path
    rank1 = tmp_path / "rank1"
    (rank1 / "ssd").mkdir(parents=True)
    (rank1 / WRITER_LOCK).write_text("")
    opened = []
    unlink = os.unlink

    def unlink_then_open(path, *args, **kw):
        unlink(path, *args, **kw)
        if os.fspath(path) == os.fspath(rank1 / WRITER_LOCK):
            opened.append(_lock_path(str(rank1)))  # (as a ParameterServer opening there does)

    monkeypatch.setattr(os, "unlink", unlink_then_open)
    try:
        with pytest.raises(hps.PathInUseError, match=f"rank 1 here: {rank1}: another run opened it while it was "
                                                     f"being removed"):
            reshard._remove_server_dir(str(rank1), "rank 1 here")
    finally:
        monkeypatch.undo()
        for fd in opened:
            os.close(fd)
    assert opened and os.listdir(rank1) == [WRITER_LOCK]


def test_a_new_ranks_directory_is_not_emptied_under_a_server(tmp_path, two_ranks):
    """2 -> 3: rank 2's directory is new to the job, and what is there an earlier
    reshard that did not finish left, unless a server is open there (a run of it,
    or another reshard's rank 2): then rank 2's share is refused, naming it, and
    the server keeps its files; once it is closed the reshard goes on."""
    import hps
    from hps import reshard
    old = copy_of(two_ranks, tmp_path)
    root = old / "job"
    before = reshard.check_source(str(root))
    reshard.write_rank(str(root), 3, 2)  # (a reshard cut short: rank 2's share written, then a server opened it)
    with _a_server_open_on(root / "rank2"):
        with pytest.raises(hps.PathInUseError, match=f"rank 2 of the job at {root} as resharded: another run has "
                                                     f"its directory open; nothing of it was removed. "
                                                     f"{root / 'rank2'}: another parameter server"):
            reshard.write_rank(str(root), 3, 2)
    done = [reshard.write_rank(str(root), 3, r) for r in range(3)]
    reshard.commit(str(root), 3, before, done[0][1])
    assert json.loads((root / "job.json").read_text())["world"] == 3


def one_process(path, steps: int, resume: bool, admission: int = 0) -> dict:
    """hps train in this process over the global batches of 2 ranks of PER_RANK."""
    from hps.train import train
    cfg = sc.train_config(str(path))
    cfg.checkpoint_every = EVERY
    if admission:
        cfg.admission = sc.admission_config(admission)
    return train(cfg, resume=resume, progress=False, train_batches=sc.global_batches(steps, PER_RANK, 2),
                 eval_batches=[])


@pytest.mark.parametrize("admission", [0, 3])
def test_a_job_resumed_in_one_process_trains_on_as_one_process(tmp_path, two_ranks, two_ranks_admission, admission,
                                                               capsys):
    """N -> 1: a 2-rank job resumed by hps train --resume without mpiexec becomes one
    parameter server at the job's root: every row whole (optimizer state too), the
    dense state (MLP, Adam's moments and step) and the admission sketch as they
    were; trained on, it equals the same reshard by the steps resumed in one
    process (exactly), and one process that trained on the global batches from
    the start (float tolerance; with admission, the job counted the job's keys)."""
    import torch
    from hps import reshard
    from hps.train import load_trainer_state
    old = copy_of(two_ranks_admission if admission else two_ranks, tmp_path)
    before = rows_of(old / "job")
    before_dense = dense_states(old / "job", 2)[0]
    shutil.copytree(old, tmp_path / "via_train")
    ref = old / "job"
    from hps.jobdir import read_job
    old_run = read_job(str(ref)).run
    reshard.to_one_process(str(ref))
    assert read_job(str(ref)).run not in (None, old_run)  # its files numbered anew: a new run
    assert rows_of(ref) == {k: (0, row, stamp) for k, (_, row, stamp) in before.items()}
    assert sorted(n for n in os.listdir(ref) if n.startswith(("rank", "job", "resharded"))) == []
    state = load_trainer_state(str(ref))
    assert state["batches_done"] == STEPS
    assert all(torch.equal(state["mlp"][n], v) for n, v in before_dense["mlp"].items())
    for i, st in before_dense["opt"]["state"].items():
        assert all(torch.equal(state["opt"]["state"][i][n], v) for n, v in st.items())
    if admission:
        assert np.array_equal(state["admission"]["sketch"]["counters"], before_dense["admission"]["sketch"]["counters"])
    from hps.jobdir import inspect
    report = inspect(str(ref), verify=True)
    assert (report["kind"], report["rows"], report["verify"]["ok"]) == ("parameter server", len(before), True)

    one_process(ref, STEPS + 4, resume=True, admission=admission)
    capsys.readouterr()
    via = one_process(tmp_path / "via_train" / "job", STEPS + 4, resume=True, admission=admission)
    assert "ran on 2 rank(s), this run has 1: resharding its checkpoint" in capsys.readouterr().err
    assert via["batches"] == STEPS + 4
    assert rows_of(tmp_path / "via_train" / "job") == rows_of(ref)
    a, b = load_trainer_state(str(tmp_path / "via_train" / "job")), load_trainer_state(str(ref))
    assert all(torch.equal(a["mlp"][n], v) for n, v in b["mlp"].items())

    # One process all along, over the same global batches.
    single = one_process(tmp_path / "single", STEPS + 4, resume=False, admission=admission)
    s = load_trainer_state(str(tmp_path / "single"))
    for n, v in s["mlp"].items():
        torch.testing.assert_close(b["mlp"][n], v, rtol=1e-4, atol=1e-6, msg=n)
    for i, st in s["opt"]["state"].items():
        for n, v in st.items():
            torch.testing.assert_close(b["opt"]["state"][i][n], v, rtol=1e-4, atol=1e-6, msg=f"{i}: {n}")
    got, want = rows_of(ref), rows_of(tmp_path / "single")
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(np.frombuffer(got[k][1], np.float32), np.frombuffer(want[k][1], np.float32),
                                   rtol=1e-4, atol=1e-6, err_msg=str(k))
    if admission:
        assert via["admission"]["default_reads"] == single["admission"]["default_reads"] > 0
        assert via["admission"]["keys_admitted"] == single["admission"]["keys_admitted"]


@pytest.mark.parametrize("change", ["dim", "admission", "sketch_bytes", "hidden", "fields", "dense_sync"])
def test_a_config_the_job_cannot_resume_with_is_refused_before_the_reshard(tmp_path, two_ranks, two_ranks_admission,
                                                                          change):
    """A resume on another number of ranks whose config the old job's checkpoint does
    not fit (another [ps] dim, [admission] threshold or sketch size, MLP hidden
    layers, data fields, [distributed] dense_sync) is refused before the reshard,
    naming the field and the checkpoint's file: it would otherwise reshard the
    whole table (here to one process, the rank directories removed; or on to
    ranks) and only then fail to open or load it, or at the first step."""
    import dataclasses
    from hps.train import AdmissionConfig, _prepare_job, train
    old = copy_of(two_ranks_admission if change == "sketch_bytes" else two_ranks, tmp_path)
    before = rows_of(old / "job")
    listing = sorted(os.listdir(old / "job"))
    cfg = sc.train_config(str(old / "job"))
    cfg.checkpoint_every = EVERY
    if change == "dim":
        cfg.ps = dataclasses.replace(cfg.ps, dim=cfg.ps.dim * 2)
        match = r"dim = 8, this run's \[ps\] has 16; nothing was resharded"
    elif change == "admission":
        cfg.admission = sc.admission_config(3)
        match = r"\[admission\] threshold = 1, this run has 3; nothing was resharded"
    elif change == "sketch_bytes":
        cfg.admission = AdmissionConfig(threshold=3, sketch_bytes="2KiB")
        match = r"sketch of 1,024 bytes, this run's \[admission\] sketch_bytes = '2KiB' \(2,048\); nothing was"
    elif change == "hidden":
        cfg.hidden = (8, 4)
        match = r"an MLP of hidden = \[16\] \(.*rank0/checkpoints/\d+/trainer-state.pt\), this run has hidden = " \
                r"\[8, 4\]; nothing was resharded"
    elif change == "fields":  # two multi-hot fields more
        match = r"an MLP of 221 inputs \(.*trainer-state.pt\), this run's data has 13 dense, 26 single-hot and 2 " \
                r"multi-hot fields, 237 inputs at dim 8; nothing was resharded"
    else:
        cfg.distributed = dataclasses.replace(cfg.distributed, dense_sync="kstep", k=3)
        match = r"\[distributed\] dense_sync = 'allreduce' \(.*trainer-state.pt: its optimizer's state\), this run " \
                r"has 'kstep'; nothing was resharded"
    with pytest.raises(ValueError, match=match):
        if change == "dense_sync":  # onto ranks (this process as the one rank of the resumed job)
            _prepare_job(cfg, _OneRank(), resume=True, widths=(13, 26, 0))
        else:
            train(cfg, resume=True, progress=False, eval_batches=[],
                  train_batches=sc.global_batches(STEPS + 2, PER_RANK, 2, multi_hot=change == "fields"))
    assert sorted(os.listdir(old / "job")) == listing  # job.json and the ranks as they were
    assert rows_of(old / "job") == before


def test_a_kstep_job_does_not_reshard_to_one_process(tmp_path, two_ranks_kstep):
    from hps import reshard
    old = copy_of(two_ranks_kstep, tmp_path)
    listing = sorted(os.listdir(old / "job"))
    with pytest.raises(ValueError, match="k-step Adam"):
        reshard.to_one_process(str(old / "job"))
    assert sorted(os.listdir(old / "job")) == listing


def test_a_reshard_refused_before_a_new_rank_is_written_leaves_no_directory_of_it(tmp_path, two_ranks):
    """2 -> 4 with a server open on rank 3's directory: the reshard made rank 2's
    directory (to hold it) and was refused at rank 3's. Rank 2's was left holding
    only its lock file, a rank the job does not have and no removal names. It goes
    as the reshard lets go; rank 3's, the server's, stays as it is; one that a rank
    wrote goes too when the reshard lets go of it without its switch (the job is the
    old one, of which it is no rank); after the switch it stays, the job's."""
    from hps import reshard
    from hps.parameter_server import METADATA, WRITER_LOCK, PathInUseError, _lock_path
    old = copy_of(two_ranks, tmp_path)
    root = old / "job"
    (root / "rank3").mkdir()
    fd = _lock_path(str(root / "rank3"))  # (as a ParameterServer open there holds it)
    try:
        with pytest.raises(PathInUseError, match=f"rank 3 of the job at {root} as resharded"):
            with reshard.Hold(str(root)) as hold:
                reshard.check_source(str(root), hold)
                reshard.take_new_ranks(str(root), 4, hold)
        assert not os.path.exists(root / "rank2")
        assert os.listdir(root / "rank3") == [WRITER_LOCK]
    finally:
        os.close(fd)
    # One left so before (an earlier reshard's crash) goes too, when this one stops short of writing it.
    (root / "rank2").mkdir()
    (root / "rank2" / WRITER_LOCK).write_text("")
    with reshard.Hold(str(root)) as hold:
        reshard.check_source(str(root), hold)
        reshard.take_new_ranks(str(root), 3, hold)
    assert not os.path.exists(root / "rank2")
    with reshard.Hold(str(root)) as hold:
        reshard.check_source(str(root), hold)
        reshard.take_new_ranks(str(root), 3, hold)
        reshard.write_rank(str(root), 3, 2, held=True)
        assert (root / "rank2" / METADATA).exists()
    assert not os.path.exists(root / "rank2")
    reshard_in_process(root, 3)
    assert (root / "rank2" / METADATA).exists()


def _killed_after_take_new_ranks(root, world: int) -> None:
    """A reshard of the job at root onto `world` ranks killed (SIGKILL: its Hold never
    lets go) once take_new_ranks made and locked the new ranks' directories, before
    any rank wrote one."""
    import signal
    import sys
    code = ("import os, signal, sys\n"
            "from hps import reshard\n"
            "hold = reshard.Hold(sys.argv[1])\n"
            "reshard.check_source(sys.argv[1], hold)\n"
            "reshard.take_new_ranks(sys.argv[1], int(sys.argv[2]), hold)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    p = subprocess.run([sys.executable, "-c", code, str(root), str(world)], capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr


class _Rank0Of2(_OneRank):
    """Rank 0 of a job of 2 (its _prepare_job in this process; no peer writes)."""

    size = 2


@pytest.mark.parametrize("how", ["ranks", "one process"])
def test_a_resume_removes_the_lock_only_rank_directories_a_killed_reshard_left_naming_them(tmp_path, two_ranks,
                                                                                          capsys, how):
    """A reshard killed between take_new_ranks and its ranks' writes left rank
    directories holding only their lock file (its Hold never let go). A resume that
    is no reshard (2 ranks on 2; a one-process server resumed in one process) never
    took them, so they stayed for good: ranks the job does not have. It removes
    them, naming each; one held (a server, or another reshard, open there) stays,
    as does one with more than its lock file in it, and the job resumes as it was."""
    from hps.parameter_server import WRITER_LOCK, _lock_path
    from hps.jobdir import read_job
    from hps.train import _prepare_job
    if how == "ranks":
        root = copy_of(two_ranks, tmp_path) / "job"
        kept = ["rank0", "rank1"]
    else:
        root = old_job(tmp_path, 1) / "job"
        kept = []
    number = read_job(str(root)).checkpoint
    _killed_after_take_new_ranks(root, 4)
    left = [f"rank{r}" for r in range(4) if f"rank{r}" not in kept]
    for name in left:
        assert os.listdir(root / name) == [WRITER_LOCK], name
    (root / "rank5").mkdir()
    held = _lock_path(str(root / "rank5"))  # (as a ParameterServer, or another reshard, open there holds it)
    (root / "rank6").mkdir()
    (root / "rank6" / "something").write_text("not only a lock")
    try:
        capsys.readouterr()
        if how == "ranks":
            assert _prepare_job(sc.train_config(str(root)), _Rank0Of2(), resume=True) == number
        else:
            one_process(root, STEPS + 2, resume=True)
        err = capsys.readouterr().err
    finally:
        os.close(held)
    assert sorted(n for n in os.listdir(root) if n.startswith("rank")) == sorted(kept + ["rank5", "rank6"])
    for name in left:
        assert f"--resume: removed {root / name}: it held only a writer lock file" in err, err
    assert "rank5" not in err and "rank6" not in err, err


def _consumer_copy(copy: dict, directory) -> None:
    """Applies the export in `directory` to a consumer's copy {key: embedding}: a full
    export replaces it; a delta upserts its rows and deletes its tombstones' keys."""
    import pyarrow.parquet as pq
    meta = json.loads((directory / "_export.json").read_text())
    table = pq.read_table(directory).to_pydict()
    if meta["full"]:
        copy.clear()
    for key, emb, tomb in zip(table["key"], table["embedding"], table["tombstone"]):
        if tomb:
            copy.pop(key, None)
        else:
            copy[key] = np.asarray(emb, np.float32).tobytes()


@pytest.mark.parametrize("how", ["opened by the job", "rank got further"])
def test_a_consumer_of_a_rank_directory_gets_every_row_across_a_reshard(tmp_path, two_ranks, how):
    """A consumer that exports from one rank's directory (its server, opened on it
    directly), then again after a reshard replaced its checkpoint, ends with the
    rank's rows, no fewer. The reshard writes the rank's checkpoint K+1 as files
    numbered anew; under the directory's old run id the position's sequence numbers
    were taken for theirs, and the delta missed every row in a file numbered at or
    below them (the rows that came from the other rank). Two ways a directory's
    metadata comes to name the new checkpoint: the job's server opens it at K+1 (job.json's),
    or the rank had finished a K+1 of its own that the job's other rank had not
    (job.json: K), which the reshard replaced. A position across it is refused as
    another run's, and a full export gives the consumer every row."""
    pytest.importorskip("pyarrow")
    import hps
    from hps.export import export
    from hps.jobdir import read_job
    from hps.parameter_server import METADATA
    root = copy_of(two_ranks, tmp_path) / "job"
    rank0 = root / "rank0"
    number = read_job(str(root)).checkpoint
    if how == "rank got further":  # (rank 0's K+1 holds K's rows: what it holds does not matter here)
        shutil.copytree(rank0 / "checkpoints" / f"{number:06d}", rank0 / "checkpoints" / f"{number + 1:06d}")
        meta = json.loads((rank0 / METADATA).read_text())
        (rank0 / METADATA).write_text(json.dumps({**meta, "checkpoint": number + 1}))
    dim = read_job(str(rank0)).config.dim
    copy: dict = {}
    export(rank0, tmp_path / "e1", "feed")
    _consumer_copy(copy, tmp_path / "e1")
    reshard_in_process(root, 3)
    if how == "opened by the job":  # (as hps train's rank 0 opens it: at job.json's checkpoint)
        meta = json.loads((rank0 / METADATA).read_text())
        config = hps.ParameterServerConfig.from_dict({**meta["config"], "path": str(rank0)})
        hps.ParameterServer(config, checkpoint=number + 1).close()
    assert read_job(str(rank0)).checkpoint == number + 1
    refused = None
    try:
        export(rank0, tmp_path / "e2", "feed")
    except ValueError as e:
        refused = str(e)
        export(rank0, tmp_path / "e2-full", "feed", full=True)
    _consumer_copy(copy, tmp_path / ("e2" if refused is None else "e2-full"))
    rows = {k: row[:4 * dim] for k, (_, row, _) in rows_of(rank0).items()}
    assert len(rows) > 10
    missing = rows.keys() - copy.keys()
    assert not missing, f"{len(missing)} of rank 0's {len(rows)} rows missing from the consumer's copy"
    assert copy == rows
    assert refused is not None and "is now run" in refused and "export with --full" in refused, refused


def test_a_commit_refuses_a_new_rank_whose_checkpoint_went_meanwhile(tmp_path, two_ranks):
    """2 -> 3 by the steps, rank 2's directory locked only while it is written: a
    server that opened it after (its metadata names no checkpoint yet, so the open
    dropped every checkpoint there, the reshard's too; now refused, rank 2 being no
    rank of the job yet) or anything else that takes checkpoint K+1 before the
    commit leaves rank 2 without it. The commit refuses to switch,
    naming it, and the old job stays as it was; switched, job.json named a
    checkpoint that rank 2 lacks, and the job could not resume."""
    import hps
    from hps import reshard
    old = copy_of(two_ranks, tmp_path)
    root = old / "job"
    before = reshard.check_source(str(root))
    done = [reshard.write_rank(str(root), 3, r) for r in range(3)]
    # The window, after rank 2's write and before the commit: a server opening rank 2
    # (no rank of the job yet) dropped the checkpoint just written; it is refused now,
    # but what else takes it (a crash, a hand) leaves the same.
    with pytest.raises(FileNotFoundError, match=f"{root / 'rank2'} is no rank of the job at {root}"):
        hps.ParameterServer.open(root / "rank2")
    gone = root / "rank2" / "checkpoints" / f"{done[0][1]:06d}"
    assert os.path.isdir(gone)
    shutil.rmtree(gone)
    with pytest.raises(FileNotFoundError, match=f"rank 2 of the job at {root} as resharded: {gone} is gone"):
        reshard.commit(str(root), 3, before, done[0][1])
    assert json.loads((root / "job.json").read_text())["world"] == 2
    reshard_in_process(root, 3)  # (resharded again, it is whole)
    assert json.loads((root / "job.json").read_text())["world"] == 3


@pytest.mark.parametrize("how", ["ranks", "one process"])
def test_a_new_ranks_directory_is_held_from_before_it_is_written_to_the_end(tmp_path, two_ranks, monkeypatch,
                                                                              how):
    """A directory the reshard writes that no old rank's was (ranks: a one-process
    job's rank 0 under mpiexec -n 1; one process: the root) is held from before its
    rank writes it to the end: a server opened after the write (here, at the seam
    between write_rank and what follows) is refused naming the reshard, which
    finishes. Before, the directory was let go after the write and taken again
    later: a server opened in between made the reshard fail (or, closed again,
    dropped the checkpoint just written)."""
    from hps import reshard
    from hps.jobdir import read_job
    from hps.train import _prepare_job
    old = old_job(tmp_path, 1) if how == "ranks" else copy_of(two_ranks, tmp_path)
    root = str(old / "job")
    number = read_job(root).checkpoint
    seen = []
    write_rank = reshard.write_rank

    def write_rank_then_open(*args, **kw):
        done = write_rank(*args, **kw)
        seen.append(_refused(old / "job" / ("rank0" if how == "ranks" else ""), root))
        return done

    monkeypatch.setattr(reshard, "write_rank", write_rank_then_open)
    if how == "ranks":
        assert _prepare_job(sc.train_config(root), _OneRank(), resume=True) == number + 1
        assert read_job(root).world == 1
    else:
        reshard.to_one_process(root)
        assert read_job(root).distributed is False and read_job(root).checkpoint == number + 1
    assert seen and seen[0]
    monkeypatch.undo()
    assert not _refused(old / "job" / ("rank0" if how == "ranks" else ""), root)  # let go at the end


@pytest.mark.parametrize("then", ["one process", "ranks"])
def test_what_a_reshard_left_to_remove_goes_before_the_job_is_resharded_again(tmp_path, two_ranks, monkeypatch,
                                                                               then):
    """A reshard of 2 ranks (one process: to 1 rank; ranks: to one process) whose
    removal of the old rank directories a crash, or a server open on one, cut
    short right after the switch, and the next run reshards again instead of
    resuming as it is (one process: back to one process; ranks: mpiexec -n 1).
    That reshard's switch replaces the record naming what is left, so it removes
    that first: before, the rank directory (and resharded-from.json) stayed for
    good, and the next run did not finish the removal as said."""
    from hps import reshard
    from hps.jobdir import read_job
    from hps.train import _prepare_job
    old = copy_of(two_ranks, tmp_path)
    root = old / "job"
    if then == "one process":
        monkeypatch.setattr(reshard, "remove_old", lambda root, hold=None: None)
        reshard_in_process(root, 1)
    else:
        monkeypatch.setattr(reshard, "remove_old_ranks", lambda root, hold=None: None)
        reshard.to_one_process(str(root))
    monkeypatch.undo()
    assert os.path.isdir(root / "rank1")
    if then == "one process":
        one_process(root, STEPS + 2, resume=True)
        assert read_job(str(root)).distributed is False
        assert dense_states(root, 1)[0]["batches_done"] == STEPS + 2
        left = []
    else:
        number = read_job(str(root)).checkpoint
        assert _prepare_job(sc.train_config(str(root)), _OneRank(), resume=True) == number + 1
        left = ["job.json", "rank0"]
    assert sorted(n for n in os.listdir(root) if n.startswith(("rank", "job", "resharded"))) == left


def _checkpoints(rank_dir) -> list:
    return sorted(os.listdir(rank_dir / "checkpoints"))


@pytest.mark.parametrize("new_world", [3, 1])
def test_a_rank_directory_opened_directly_after_the_switch_keeps_the_checkpoint_job_json_names(tmp_path, two_ranks,
                                                                                                 new_world):
    """2 -> 3 (and 2 -> 1) ranks, switched; then, before the job's own servers have
    opened them, a user opens each ``<job>/rank<r>`` directly (hps.ParameterServer.open,
    to inspect or serve one rank). An old rank's metadata still names the old
    checkpoint K (a new rank's none), job.json names K+1: opened at the metadata's,
    the open dropped K+1, and the job could no longer resume. Each opens at
    job.json's K+1, as the job's own server does, and the job resumes from it."""
    import hps
    from hps.jobdir import read_job
    old = copy_of(two_ranks, tmp_path)
    root = old / "job"
    number = read_job(str(root)).checkpoint
    reshard_in_process(root, new_world)
    assert json.loads((root / "job.json").read_text())["checkpoint"] == number + 1
    assert _checkpoints(root / "rank0") == [f"{number:06d}", f"{number + 1:06d}"]
    rows = rows_of(root)
    for r in range(new_world):
        server = hps.ParameterServer.open(root / f"rank{r}")
        try:
            assert server.checkpoint_number == number + 1
        finally:
            server.close()
        assert _checkpoints(root / f"rank{r}") == [f"{number + 1:06d}"]
        assert json.loads((root / f"rank{r}" / "hps-parameter-server.json").read_text())["checkpoint"] == number + 1
    assert rows_of(root) == rows
    scenario(new_world, old, "--steps", STEPS + 2, "--resume")
    assert dense_states(root, new_world)[0]["batches_done"] == STEPS + 2


def test_a_rank_directory_opened_directly_after_its_rank_got_further_keeps_the_checkpoint_job_json_names(
        tmp_path, two_ranks):
    """The other order: rank 0 finished checkpoint K+1 (its metadata names it), the
    job died before job.json named it (K). Opened directly at its metadata's K+1,
    the open dropped K, which job.json names. It rolls back to K, as the job's
    resume does, and the job resumes."""
    import hps
    from hps.jobdir import read_job
    from hps.parameter_server import METADATA
    old = copy_of(two_ranks, tmp_path)
    root = old / "job"
    rank0 = root / "rank0"
    number = read_job(str(root)).checkpoint
    rows = rows_of(root)
    shutil.copytree(rank0 / "checkpoints" / f"{number:06d}", rank0 / "checkpoints" / f"{number + 1:06d}")
    meta = json.loads((rank0 / METADATA).read_text())
    (rank0 / METADATA).write_text(json.dumps({**meta, "checkpoint": number + 1}))
    hps.ParameterServer.open(rank0).close()
    assert _checkpoints(rank0) == [f"{number:06d}"]
    assert rows_of(root) == rows
    scenario(2, old, "--steps", STEPS + 2, "--resume")
    assert dense_states(root, 2)[0]["batches_done"] == STEPS + 2


def test_a_rank_directory_missing_the_checkpoint_job_json_names_is_refused_and_keeps_its_own(tmp_path, two_ranks):
    """job.json names a checkpoint rank 0's directory lacks (damage): a direct open
    is refused, naming both checkpoints, and drops nothing of what the rank holds."""
    import hps
    from hps.jobdir import read_job
    old = copy_of(two_ranks, tmp_path)
    root = old / "job"
    number = read_job(str(root)).checkpoint
    job = json.loads((root / "job.json").read_text())
    (root / "job.json").write_text(json.dumps({**job, "checkpoint": number + 1}))
    before = _listing(root / "rank0")
    with pytest.raises(FileNotFoundError, match=rf"job\.json names checkpoint {number + 1}.*its metadata names "
                                                rf"{number}"):
        hps.ParameterServer.open(root / "rank0")
    assert _listing(root / "rank0") == before


def test_a_rank_directory_no_rank_of_the_job_is_refused_after_a_reshard(tmp_path, two_ranks, monkeypatch):
    """After a reshard to 1 rank, old rank 1's directory (left for removal) is no rank
    of the job: opened, it resumed at its own checkpoint and took writes that the
    next resume removed, while hps inspect, export and Lookup refuse it. A
    ParameterServer opened there is refused alike, naming it and job.json, and the
    next resume removes it."""
    import hps
    from hps import reshard
    from hps.train import _prepare_job
    old = copy_of(two_ranks, tmp_path)
    root = old / "job"
    monkeypatch.setattr(reshard, "remove_old", lambda root, hold=None: None)  # (rank 1 left for removal)
    reshard_in_process(root, 1)
    monkeypatch.undo()
    before = _listing(root / "rank1")
    with pytest.raises(FileNotFoundError, match=re.escape(f"{root / 'rank1'} is no rank of the job at {root}, which "
                                                          f"has 1 ranks ({root / 'job.json'})")):
        hps.ParameterServer.open(root / "rank1")
    assert _listing(root / "rank1") == before
    number = json.loads((root / "job.json").read_text())["checkpoint"]
    assert _prepare_job(sc.train_config(str(root)), _OneRank(), resume=True) == number
    assert not os.path.exists(root / "rank1")


def test_reading_a_rank_directory_after_the_switch_deletes_nothing(tmp_path, two_ranks):
    """hps inspect, hps serve (hps.Lookup) and hps export given a rank directory after
    a reshard's switch, before the job's server opened it: they read (a pinned view)
    and drop no checkpoint; the job resumes after."""
    pytest.importorskip("pyarrow")
    from hps.export import export
    from hps.jobdir import inspect, read_job
    from hps.lookup import Lookup
    old = copy_of(two_ranks, tmp_path)
    root = old / "job"
    number = read_job(str(root)).checkpoint
    reshard_in_process(root, 3)
    listed = {r: _checkpoints(root / f"rank{r}") for r in range(3)}
    inspect(str(root / "rank0"), verify=True)
    lookup = Lookup(root / "rank0", "64MiB")
    lookup.close()
    export(root / "rank0", tmp_path / "e", "feed")
    assert {r: _checkpoints(root / f"rank{r}") for r in range(3)} == listed
    assert f"{number + 1:06d}" in listed[0]
    scenario(3, old, "--steps", STEPS + 2, "--resume")
    assert dense_states(root, 3)[0]["batches_done"] == STEPS + 2
