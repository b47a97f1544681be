"""The training pipeline: pipelined == sequential, exactly; stage stats; `hps train`."""
import json
import os
import platform
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install torch)")
import hps  # noqa: E402
from hps.train import DataConfig, TrainConfig, auc, load_trainer_state, train  # noqa: E402

SMALL_VOCAB = [50, 200, 1000, 50_000] + [3000] * 22
GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"  # where keep_freed_memory sets malloc
# Host partitions on this topology's routes: a device tier that holds copies of MEM-PS's rows.
TOPOLOGY = Path(__file__).resolve().parents[1] / "examples" / "topologies" / "pcie_only.toml"


def config(path, **kw):
    data = DataConfig(batch_size=512, train_examples=512 * 12, eval_examples=2048, vocab_sizes=SMALL_VOCAB)
    ps = hps.ParameterServerConfig(dim=4, path=str(path), optimizer=hps.AdaGrad(lr=0.05),
                                   mem_budget=22_000 * (4 * 2 * 4 + 112), devices=kw.pop("devices", 1),
                                   write_buffer_rows=256, ssd=hps.SsdOptions(file_records=512))
    return TrainConfig(ps=ps, data=data, hidden=(16,), dense_lr=0.01, torch_threads=1, **kw)


def final_rows(path):
    ps = hps.ParameterServer.open(path)
    keys = np.unique(np.concatenate([b.keys.ravel() for b in hps.data.SyntheticCriteo(
        seed=0, batch_size=512, examples=512 * 12, vocab_sizes=SMALL_VOCAB)]))
    return ps.pull(keys)


@pytest.mark.parametrize("devices", [2, 1])  # 1: host batches on MEM-PS's rows, no device tables
def test_pipelined_training_equals_sequential_exactly(tmp_path, devices):
    seq = train(config(tmp_path / "seq", pipelined=False, devices=devices), progress=False)
    pip = train(config(tmp_path / "pip", pipelined=True, devices=devices), progress=False)
    np.testing.assert_array_equal(final_rows(tmp_path / "seq"), final_rows(tmp_path / "pip"))
    assert seq["final"]["auc"] == pip["final"]["auc"]
    mlp_seq = load_trainer_state(tmp_path / "seq")["mlp"]
    mlp_pip = load_trainer_state(tmp_path / "pip")["mlp"]
    for name in mlp_seq:
        assert torch.equal(mlp_seq[name], mlp_pip[name]), name
    p = pip["pipeline"]
    assert p["batches"] == 12 and p["examples"] == 512 * 12
    assert p["bound_by"] in ("read", "prefetch", "load", "train")
    assert all(v >= 0 for v in p["busy_seconds"].values())
    # The cache was too small for the run: rows went to SSD-PS and came back.
    assert pip["ps"]["counts"]["ssd_hits"] > 0 and pip["ps"]["mem"]["dirty_evictions"] > 0


def test_a_pipelined_runs_evaluations_read_what_a_sequential_runs_read(tmp_path, monkeypatch):
    """eval_every's evaluations pull from MEM-PS in the train step of batch t, while
    the writer writes batch t - 1 back: on a tier that holds copies of the rows (GPUs;
    here host partitions with a topology's routes), they read its rows half written or
    not at all, as the writer's pace had it, and their metrics differed from a
    sequential run's. Here the writer holds batch 3's write-back until the train step
    of batch 4 (an evaluation) reads the server or waits for the write-backs before it."""
    def copies(path, pipelined):
        cfg = config(path, pipelined=pipelined, devices=2, eval_every=4)
        cfg.ps.topology = str(TOPOLOGY)
        return cfg
    seq = train(copies(tmp_path / "seq", pipelined=False), progress=False)

    reading = threading.Event()
    write_backs = []
    write_back, evaluate = hps.parameter_server.Batch.write_back, hps.train.Trainer.evaluate
    wait_for_write_backs = getattr(hps.pipeline.Pipeline, "wait_for_write_backs", None)

    def held_write_back(self):
        if threading.current_thread().name == "hps-writer":
            write_backs.append(self)
            if len(write_backs) == 3:
                assert reading.wait(timeout=60)
        write_back(self)

    def reads(method):
        def wrapped(self, *args):
            reading.set()
            return method(self, *args)
        return wrapped

    monkeypatch.setattr(hps.parameter_server.Batch, "write_back", held_write_back)
    monkeypatch.setattr(hps.train.Trainer, "evaluate", reads(evaluate))
    if wait_for_write_backs is not None:
        monkeypatch.setattr(hps.pipeline.Pipeline, "wait_for_write_backs", reads(wait_for_write_backs))
    pip = train(copies(tmp_path / "pip", pipelined=True), progress=False)

    def metrics(summary):
        return [(h["batches"], h["auc"], h["logloss"]) for h in summary["history"]]
    assert len(pip["history"]) == 4 and metrics(pip) == metrics(seq)


def test_resume_continues_to_the_same_result(tmp_path):
    whole = train(config(tmp_path / "whole", checkpoint_every=4), progress=False)
    half = config(tmp_path / "half", checkpoint_every=4)
    half.data.train_examples = 512 * 8
    train(half, progress=False)
    rest = config(tmp_path / "half", checkpoint_every=4)
    resumed = train(rest, resume=True, progress=False)
    assert resumed["batches"] == 12
    np.testing.assert_array_equal(final_rows(tmp_path / "whole"), final_rows(tmp_path / "half"))
    assert resumed["final"]["auc"] == whole["final"]["auc"]
    with pytest.raises(ValueError, match=r"already holds a parameter server \(checkpoint 4\); pass --resume"):
        train(config(tmp_path / "whole"), progress=False)


def test_a_resume_whose_path_another_run_checkpointed_meanwhile_is_refused(tmp_path, monkeypatch):
    """A resume reads the server's last checkpoint before its server takes the path's
    lock. Another resume that opened, trained and checkpointed in between made that
    number stale, and opening at it rolled the other run's newer checkpoint back
    (opening drops every other checkpoint). The open now checks, under the lock,
    that the server still names what this run read, and refuses otherwise, changing
    nothing."""
    import hps.train as ht
    path = tmp_path / "ps"
    first = config(path, checkpoint_every=4)
    first.data.train_examples = 512 * 4
    train(first, progress=False)
    real = ht.stored_checkpoint
    raced = []

    def stored_then_another_run(p):
        read = real(p)
        if not raced:  # the other resume runs in this one's window, once
            raced.append(True)
            other = config(path, checkpoint_every=4)
            other.data.train_examples = 512 * 8
            assert train(other, resume=True, progress=False)["batches"] == 8
        return read
    monkeypatch.setattr(ht, "stored_checkpoint", stored_then_another_run)
    read = real(str(path))[1]  # this run's, before the other's
    with pytest.raises(hps.PathInUseError, match=rf"{path}: another run changed it while this one was opening it "
                                                  rf"\(its checkpoint is now \d+, where this run read {read}\)") as refused:
        train(config(path, checkpoint_every=4), resume=True, progress=False)
    after = real(str(path))[1]  # the other run's last checkpoint, kept: opening at `read` dropped it
    assert after > read and f"now {after}," in str(refused.value)
    monkeypatch.setattr(ht, "stored_checkpoint", real)
    assert train(config(path, checkpoint_every=4), resume=True, progress=False)["batches"] == 12


def test_a_server_that_opens_while_a_run_is_discarded_is_refused_not_removed(tmp_path, monkeypatch):
    """A rerun removes what a run that never checkpointed left at its path. It checked
    that no server held the path's lock, let go, and then removed: a server that opened
    there in between (another hps train) had its metadata and store removed from under
    it. The removal now holds the lock throughout, and that server is refused."""
    import hps.train as ht
    from hps.parameter_server import METADATA, WRITER_LOCK
    path = tmp_path / "ps"
    hps.ParameterServer(config(path).ps).close()  # a run that ended before its first checkpoint
    real = ht._remove_tree
    other = []

    def another_run_opens_first(p):
        if not other:  # in the window, once
            try:
                other.append(hps.ParameterServer(config(path).ps))
            except hps.PathInUseError as e:
                other.append(e)
        real(p)
    monkeypatch.setattr(ht, "_remove_tree", another_run_opens_first)
    ht._discard_run(str(path))
    if isinstance(other[0], hps.ParameterServer):
        assert (path / METADATA).exists(), "the server that opened meanwhile lost its files"
    assert isinstance(other[0], hps.PathInUseError), other[0]
    assert str(other[0]).startswith(f"{path}: another parameter server has this path open (pid {os.getpid()} on ")
    assert not os.listdir(path)  # (the lock file too, removed last)
    monkeypatch.setattr(ht, "_remove_tree", real)
    assert train(config(path), progress=False)["batches"] == 12
    assert (path / WRITER_LOCK).exists()


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_without_a_checkpoint_yet_is_not_discarded_while_it_runs(tmp_path, capsys, resume):
    """A second hps train at the path of one that runs and has not checkpointed yet
    is refused naming the path and the holder, and says nothing of starting over."""
    from hps.train import Trainer
    path = tmp_path / "ps"
    first = Trainer(config(path))
    before = sorted(os.listdir(path))
    capsys.readouterr()
    with pytest.raises(hps.PathInUseError) as refused:
        train(config(path), resume=resume, progress=False)
    assert str(refused.value).startswith(f"{path} holds a run that has not finished a checkpoint and is still "
                                         f"running: it was not removed. {path}: another parameter server has "
                                         f"this path open (pid {os.getpid()} on "), refused.value
    assert "starting it over" not in capsys.readouterr().err
    assert sorted(os.listdir(path)) == before
    first.ps.close()


def test_a_rank_refuses_a_job_manifest_another_run_changed_before_it_opened(tmp_path):
    """A rank opens its server at the checkpoint rank 0 read from job.json; under
    its lock it checks that job.json still names that checkpoint and world."""
    from hps.train import JOB_MANIFEST, _job_still_at
    (tmp_path / JOB_MANIFEST).write_text(json.dumps({"world": 2, "step": 8, "checkpoint": 3, "run": "a"}))
    _job_still_at(str(tmp_path), 2, 3)(None)  # unchanged: opens
    with pytest.raises(hps.PathInUseError, match=r"\(its checkpoint is now 3 of 2 ranks, where this run read 2 of "
                                                  r"2 ranks\); nothing was changed"):
        _job_still_at(str(tmp_path), 2, 2)({"checkpoint": 2})
    with pytest.raises(hps.PathInUseError, match=r"now 3 of 2 ranks, where this run read 3 of 4 ranks"):
        _job_still_at(str(tmp_path), 4, 3)(None)
    (tmp_path / JOB_MANIFEST).unlink()
    with pytest.raises(hps.PathInUseError, match=r"now None of None ranks"):
        _job_still_at(str(tmp_path), 2, 3)(None)


def test_the_model_learns(tmp_path):
    cfg = config(tmp_path / "ps")
    cfg.data.train_examples = 512 * 40
    summary = train(cfg, progress=False)
    assert summary["final"]["auc"] > 0.7, summary["final"]
    assert summary["malloc"]["kept"] is GLIBC, summary["malloc"]


@pytest.mark.skipif(not GLIBC, reason="keep_freed_memory sets glibc's malloc; this libc is not glibc")
def test_keep_freed_memory_spares_each_step_faulting_its_tensors_in_again():
    """A step's temporaries (three 7 MB blocks, as a batch's MLP input and
    gradients are), freed and allocated again 20 times. With glibc's defaults the
    freed heap is given back and every step faults its pages in anew; after
    keep_freed_memory they come back from the heap. In a process of its own:
    mallopt holds for the whole process."""
    code = textwrap.dedent("""
        import resource, sys, numpy as np
        from hps.tuning import keep_freed_memory
        if sys.argv[1] == "keep":
            assert keep_freed_memory() == {"kept": True, "mmap_threshold_bytes": 32 << 20,
                                           "trim_threshold_bytes": 256 << 20}
        def step():
            blocks = [np.empty((4096, 429), np.float32) for _ in range(3)]
            for b in blocks:
                b.fill(1.0)
        for _ in range(3):
            step()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(20):
            step()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """)
    faults = {mode: int(subprocess.run([sys.executable, "-c", code, mode], check=True, capture_output=True,
                                       text=True).stdout.split()[-1]) for mode in ("default", "keep")}
    pages_a_step = 3 * 4096 * 429 * 4 // 4096
    # glibc gave back part of the freed heap each step (a block of three here: 30,780 faults)
    assert faults["default"] > 2 * pages_a_step, faults
    assert faults["keep"] < pages_a_step, faults           # not one whole step's worth over 20 steps


def test_keep_freed_memory_refuses_a_bad_threshold_and_the_config_a_non_bool(tmp_path):
    from hps.tuning import keep_freed_memory
    for bad in (0, -1, 1 << 31, 2.5, True):
        with pytest.raises(ValueError, match=r"trim_bytes must be an int in \(0, 2\^31\), got"):
            keep_freed_memory(bad)
    d = {"ps": {"dim": 4, "path": str(tmp_path / "ps")}, "keep_freed_memory": 1}
    with pytest.raises(ValueError, match=r"run.toml: keep_freed_memory must be true or false, got 1"):
        TrainConfig.from_dict(d, "run.toml")
    assert TrainConfig.from_dict({**d, "keep_freed_memory": False}, "run.toml").keep_freed_memory is False


def test_auc_matches_a_pairwise_count():
    rng = np.random.default_rng(0)
    y = rng.random(300) < 0.3
    s = np.round(rng.random(300), 1)  # many ties
    pos, neg = s[y], s[~y]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert auc(y, s) == pytest.approx(pairs / (len(pos) * len(neg)))
    # A NaN score sorts anywhere: a diverged model got an AUC of noise (0.49), not "undefined".
    s[7] = np.nan
    assert np.isnan(auc(y, s)) and np.isnan(auc(y, np.where(y, np.inf, 0.0)))
    # ... and the summary's JSON line carried it as a bare NaN (numpy's float passed as is).
    from hps.train import _jsonable
    assert json.dumps(_jsonable({"logloss": np.float64("nan"), "auc": float("nan"), "x": [np.float32(0.5)]}),
                      allow_nan=False) == '{"logloss": null, "auc": null, "x": [0.5]}'


def test_hps_train_command_line(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(textwrap.dedent(f"""
        hidden = [16]
        eval_every = 4
        torch_threads = 1
        [ps]
        dim = 4
        path = "{tmp_path / 'ps'}"
        mem_budget = "2MiB"
        [ps.optimizer]
        kind = "adagrad"
        lr = 0.05
        [data]
        batch_size = 256
        train_examples = 2048
        eval_examples = 1024
        vocab_sizes = {SMALL_VOCAB}
    """))
    run = subprocess.run([sys.executable, "-m", "hps.cli", "train", "--config", str(toml), "--no-progress",
                          "--examples", "3072"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["pipeline"]["examples"] == 3072 and 0 < out["final"]["auc"] < 1  # learning: test_the_model_learns
    assert "eval AUC" in run.stderr and "bound by stage" in run.stderr
    assert os.path.exists(tmp_path / "ps" / "train-summary.json")
    bad = tmp_path / "bad.toml"
    bad.write_text('[ps]\ndim = 4\npath = "x"\n[data]\nbatch_sise = 3\n')
    run = subprocess.run([sys.executable, "-m", "hps.cli", "train", "--config", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "unknown field(s) data.batch_sise" in run.stderr


def test_the_example_config_parses():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = TrainConfig.from_toml(os.path.join(root, "examples", "train.toml"))
    assert cfg.ps.dim == 16 and cfg.ps.optimizer == hps.AdaGrad(lr=0.05) and cfg.data.batch_size == 4096
    assert cfg.hidden == (512, 256) and cfg.checkpoint_every == 500


def test_hps_train_reads_criteo_tsv_files(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sample = os.path.join(root, "..", "shared", "data", "criteo-sample", "train_examples_10k.tsv")
    if not os.path.exists(sample):
        pytest.skip(f"the Criteo sample is not at {sample}")
    # Its first 8,000 lines trained on, the last 2,000 held out (one file for both is
    # refused: the evaluations would score the rows trained on).
    lines = Path(sample).read_text().splitlines(keepends=True)
    (tmp_path / "train.tsv").write_text("".join(lines[:8000]))
    (tmp_path / "held.tsv").write_text("".join(lines[8000:]))
    cfg = config(tmp_path / "ps")
    cfg.data = DataConfig(source=str(tmp_path / "train.tsv"), eval_source=str(tmp_path / "held.tsv"),
                          batch_size=1024, eval_examples=2048)
    summary = train(cfg, progress=False)
    assert summary["examples"] == 8000 and summary["batches"] == 8
    assert summary["final"]["eval_examples"] == 2000 and 0 < summary["final"]["auc"] < 1


def test_prefetch_waits_for_room_instead_of_failing(tmp_path):
    """A budget for about one and a half batches: the prefetch of the next batch
    waits for the current one's write-back; the result equals the sequential run."""
    tight = config(tmp_path / "tight")
    tight.ps.mem_budget = 7000 * (4 * 2 * 4 + 112)
    summary = train(tight, progress=False)
    assert summary["batches"] == 12 and summary["pipeline"]["prefetch_waits"] > 0
    seq = config(tmp_path / "seq", pipelined=False)
    seq.ps.mem_budget = tight.ps.mem_budget
    train(seq, progress=False)
    np.testing.assert_array_equal(final_rows(tmp_path / "tight"), final_rows(tmp_path / "seq"))
    tiny = config(tmp_path / "tiny")
    tiny.ps.mem_budget = 1000 * (4 * 2 * 4 + 112)  # not even one batch
    with pytest.raises(hps.CacheFullError, match="MEM-PS budget too small"):
        train(tiny, progress=False)


def test_prefetch_retries_when_the_last_batch_in_flight_is_written_back_during_the_attempt():
    """The attempt failed while a batch held its pins; that batch's write-back then
    finished before the prefetch judged the failure. The prefetch tries again
    rather than blaming the budget (CI caught the old check racing this)."""
    from hps.pipeline import Pipeline

    class RacingServer:
        attempts = 0

        def prefetch(self, keys):
            self.attempts += 1
            if self.attempts == 1:
                pipeline._write_back(SimpleNamespace(batch=SimpleNamespace(write_back=lambda: None),
                                                     data=SimpleNamespace(labels=np.zeros(4))))
                raise hps.CacheFullError("MEM-PS budget too small: the batch in flight holds the room")
            return "pinned"

    server = RacingServer()
    pipeline = Pipeline(server, lambda loaded: None, devices=1)
    pipeline._in_flight = 1
    assert pipeline._prefetch(SimpleNamespace(keys=np.arange(3, dtype=np.uint64))) == "pinned"
    assert server.attempts == 2 and pipeline._in_flight == 1 and pipeline.stats.prefetch_waits == 0

    # With nothing in flight and no write-back meanwhile, the budget is too small: it raises.
    class FullServer:
        def prefetch(self, keys):
            raise hps.CacheFullError("MEM-PS budget too small: not one batch fits")

    pipeline = Pipeline(FullServer(), lambda loaded: None, devices=1)
    with pytest.raises(hps.CacheFullError, match="not one batch fits"):
        pipeline._prefetch(SimpleNamespace(keys=np.arange(3, dtype=np.uint64)))


def test_cpu_seconds_count_a_stage_threads_work_not_its_waits():
    """Each stage's CPU time (its thread's time.thread_time) beside its busy (wall)
    time: a read stage that only sleeps costs next to no CPU however long it is
    busy; a train step that spins costs at least the CPU it spun. (It spins for its
    thread's CPU time, not the clock's: on a loaded machine a thread spinning by the
    clock gets a share of a core, and a bound on that share failed there.)"""
    from hps.pipeline import STAGES, Pipeline

    def spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def source():
        for _ in range(4):
            time.sleep(0.05)  # 0.2 s busy in all, no CPU
            yield SimpleNamespace(keys=np.arange(3, dtype=np.uint64), labels=np.zeros(4))

    batch = SimpleNamespace(wait_seconds=0.0, apply=lambda: None, write_back=lambda: None, abort=lambda: None)
    server = SimpleNamespace(prefetch=lambda keys: SimpleNamespace(release=lambda: None),
                             batch=lambda prefetched, overlap=False: batch)
    stats = Pipeline(server, lambda loaded: spin(0.05), devices=1).run(source())  # 0.2 s of spinning
    assert stats.batches == 4
    d = stats.as_dict()
    assert set(d["cpu_seconds"]) == set(STAGES) and d["cpu_seconds"] == stats.cpu_seconds
    assert all(v >= 0 for v in stats.cpu_seconds.values())
    assert stats.busy_seconds["read"] >= 0.2 and stats.cpu_seconds["read"] < 0.05
    assert stats.cpu_seconds["train"] >= 0.19 and stats.busy_seconds["train"] >= 0.9 * stats.cpu_seconds["train"]


def test_the_read_stage_reads_at_most_batches_ahead_past_the_batch_trained():
    """What the read stage does to a batch (admission counts it, and keeps a copy of
    its counters at each evaluation) runs ahead of training by up to
    hps.pipeline.batches_ahead() batches, which the admission memory check counts
    on: no more, however long a step takes, and that many while a step waits."""
    from hps.pipeline import DEPTHS, Pipeline, batches_ahead
    read, trained, ahead = [0], [0], []

    def source():
        for _ in range(16):
            read[0] += 1  # (as the read stage's admission counts a batch: in next())
            yield SimpleNamespace(keys=np.arange(3, dtype=np.uint64), labels=np.zeros(4))

    def step(loaded):
        trained[0] += 1
        if trained[0] <= 4:  # the other stages fill their queues while this step waits
            end = time.perf_counter() + 5.0
            while read[0] - trained[0] < batches_ahead() and time.perf_counter() < end:
                time.sleep(0.01)
            time.sleep(0.1)  # (room for one more, were there any)
        ahead.append(read[0] - trained[0])

    batch = SimpleNamespace(wait_seconds=0.0, apply=lambda: None, write_back=lambda: None, abort=lambda: None)
    server = SimpleNamespace(prefetch=lambda keys: SimpleNamespace(release=lambda: None),
                             batch=lambda prefetched, overlap=False: batch)
    assert Pipeline(server, step, devices=1).run(source()).batches == 16
    assert batches_ahead() == sum(DEPTHS) + 3 == 9
    assert ahead[:4] == [9] * 4 and max(ahead) == 9


@pytest.mark.parametrize("failing", ["train", "load"])
def test_a_stage_that_raises_is_reported_before_the_other_stages_are_joined(failing):
    """on_error hears of a stage's exception while the other stages still run: in a
    distributed job one of them may wait in a collective for peers that wait for the
    failed stage, so the join would never end (hps.train ends the job here). Here
    the train step of batch 1 and the load of batch 2 run together; one raises, and
    the other waits until on_error is called (10 s at most) and records whether it was."""
    from hps.pipeline import Pipeline
    told, released, loading, waits = [], threading.Event(), threading.Event(), []
    message = "the step failed" if failing == "train" else "the loader failed"

    def source():
        for _ in range(6):
            yield SimpleNamespace(keys=np.arange(3, dtype=np.uint64), labels=np.zeros(4))

    loads = [0]

    def load(prefetched, overlap=False):
        loads[0] += 1
        if loads[0] == 2:
            loading.set()
            if failing == "load":
                raise OSError(message)
            waits.append(released.wait(10.0))  # True: on_error was called first
        return SimpleNamespace(wait_seconds=0.0, apply=lambda: None, write_back=lambda: None, abort=lambda: None)

    def step(loaded):
        if failing == "train":
            assert loading.wait(10.0)  # the load of batch 2 has begun
            raise RuntimeError(message)
        waits.append(released.wait(10.0))

    def on_error(e):
        told.append(e)
        released.set()

    server = SimpleNamespace(prefetch=lambda keys: SimpleNamespace(release=lambda: None), batch=load)
    with pytest.raises((RuntimeError, OSError), match=message):
        Pipeline(server, step, devices=1, on_error=on_error).run(source())
    assert [str(e) for e in told] == [message] and waits == [True]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own niceness is Linux's")
def test_helper_threads_run_at_helper_nice_and_the_trainer_does_not(tmp_path):
    """Read, prefetch, load and write back run at the pipeline's helper_nice; the
    caller's thread, which trains, keeps its niceness."""
    from hps.pipeline import Pipeline

    def nice_here():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen = {"read": set(), "prefetch": set(), "train": set()}
    base = nice_here()

    def source():
        for b in hps.data.SyntheticCriteo(seed=0, batch_size=256, examples=256 * 4, vocab_sizes=SMALL_VOCAB):
            seen["read"].add(nice_here())
            yield b

    def keys_of(data):
        seen["prefetch"].add(nice_here())
        return data.keys

    ps = hps.ParameterServer(hps.ParameterServerConfig(dim=4, path=str(tmp_path / "ps"), mem_budget="64MiB"))
    pipeline = Pipeline(ps, lambda loaded: seen["train"].add(nice_here()), keys_of=keys_of,
                        helper_nice=max(base, 7))
    stats = pipeline.run(source())
    assert stats.batches == 4 and stats.helper_nice == max(base, 7)
    assert seen == {"read": {max(base, 7)}, "prefetch": {max(base, 7)}, "train": {base}}
    assert nice_here() == base
    for bad in (-1, 20, True, 3.0):
        with pytest.raises(ValueError, match=r"helper_nice must be an int in \[0, 19\], got"):
            Pipeline(ps, lambda loaded: None, helper_nice=bad)


def test_thread_tuner_keeps_the_faster_thread_count(monkeypatch):
    from hps import train as htrain

    class FakeTorch:
        def __init__(self):
            self.threads, self.calls = 0, []

        def set_num_threads(self, n):
            self.threads = n
            self.calls.append(n)

        def get_num_threads(self):
            return self.threads

    clock = [0.0]
    monkeypatch.setattr(htrain.time, "perf_counter", lambda: clock[0])
    fake = FakeTorch()
    tuner = htrain.ThreadTuner(fake, cores=4, warmup=2, probe=3)
    batch = 0
    for _ in range(60):
        batch += 1
        # One fewer thread is faster, and the whole run speeds up halfway through the probes.
        seconds = {4: 2.0, 3: 1.6}[fake.threads] * (1.0 if batch < 12 else 0.5)
        clock[0] += seconds
        tuner.step(100)
    # A B B A said 3; a second A B B A confirmed it; then the faster.
    assert fake.calls == [4, 3, 4, 3, 4, 3] and tuner.chosen == 3
    assert tuner.rates[3] > tuner.rates[4]
    d = tuner.as_dict()
    assert d["chosen"] == 3 and set(d["examples_per_s"]) == {"4", "3"} and d["passes"] == 2

    # A first pass misled by a slow spell on every core (3 is not faster): the second
    # pass does not confirm it, and the tuner keeps every core.
    clock[0], fake, batch = 0.0, FakeTorch(), 0
    tuner = htrain.ThreadTuner(fake, cores=4, warmup=2, probe=3)
    for _ in range(80):
        batch += 1
        clock[0] += 2.0 * (1.5 if fake.threads == 4 and batch <= 18 else 1.0)  # pass 1 ends at batch 18
        tuner.step(100)
    assert tuner.passes == 2 and tuner.chosen == 4 and fake.calls[-1] == 4

    # Equal speeds but a run that speeds up: A B B A does not mistake the drift for 3 being faster.
    clock[0], fake = 0.0, FakeTorch()
    tuner = htrain.ThreadTuner(fake, cores=4, warmup=2, probe=3)
    for i in range(60):
        clock[0] += 2.0 - i * 0.02
        tuner.step(100)
    assert tuner.rates[4] == pytest.approx(tuner.rates[3], rel=0.02)
    assert tuner.chosen == 4  # not clearly faster with fewer: all cores
    one_core = htrain.ThreadTuner(FakeTorch(), cores=1)
    assert one_core.chosen == 1 and one_core.torch.calls == [1]


def test_thread_tuner_probes_the_cpus_this_process_may_run_on(monkeypatch, tmp_path):
    # taskset, a cpuset (docker --cpuset-cpus, Slurm) or bind_cores leave the process fewer
    # CPUs than the machine has: os.cpu_count() counts the machine's. The tuner started
    # torch on 64 threads (and probed 63) on 2 CPUs, each step's threads fighting for them.
    from hps import train as htrain
    monkeypatch.setattr(htrain.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(htrain.os, "sched_getaffinity", lambda pid: {3, 5}, raising=False)
    cfg = htrain.TrainConfig.from_dict({"ps": {"dim": 4, "path": str(tmp_path / "ps"), "mem_budget": "8MiB"},
                                        "hidden": [8], "torch_threads": 0}, "run.toml")
    threads = torch.get_num_threads()
    try:
        trainer = htrain.Trainer(cfg)
        assert trainer.thread_tuner.candidates == [2, 1] and torch.get_num_threads() == 2
        trainer.ps.close()
    finally:
        torch.set_num_threads(threads)
    # Where the platform has no affinity call, the machine's count is what there is.
    from hps.tuning import usable_cpus
    monkeypatch.delattr(htrain.os, "sched_getaffinity")
    assert usable_cpus() == 64


def test_thread_tuner_refuses_counts_it_cannot_time():
    # warmup = 0 left the first probe without a start time: a TypeError 8 batches into
    # the run, far from the argument that caused it. Named at construction now.
    from hps.tuning import ThreadTuner

    class FakeTorch:
        def set_num_threads(self, n):
            pass
    for kw, name in (({"warmup": 0}, "warmup"), ({"probe": 0}, "probe"), ({"cores": 0}, "cores")):
        with pytest.raises(ValueError, match=rf"ThreadTuner: {name} must be an int >= 1, got 0"):
            ThreadTuner(FakeTorch(), **{"cores": 4, **kw})


def test_thread_tuner_stops_early_when_every_core_is_clearly_faster(monkeypatch):
    from hps import train as htrain
    clock = [0.0]
    monkeypatch.setattr(htrain.time, "perf_counter", lambda: clock[0])

    class FakeTorch:
        def __init__(self):
            self.threads, self.calls = 0, []

        def set_num_threads(self, n):
            self.threads = n
            self.calls.append(n)

    fake = FakeTorch()
    tuner = htrain.ThreadTuner(fake, cores=2, warmup=2, probe=3)
    on_one = 0
    for _ in range(40):
        on_one += fake.threads == 1
        clock[0] += {2: 1.0, 1: 1.4}[fake.threads]  # every core 1.4x faster
        tuner.step(100)
    # A, then B (after SETTLE batches), then the verdict: no second B, no second A.
    assert fake.calls == [2, 1, 2] and tuner.chosen == 2 and tuner.passes == 1
    assert on_one == tuner.SETTLE + 3
    assert tuner.rates[2] == pytest.approx(1.4 * tuner.rates[1])

    # Faster, but not clearly: the whole A B B A runs, and every core stays.
    fake = FakeTorch()
    tuner = htrain.ThreadTuner(fake, cores=2, warmup=2, probe=3)
    for _ in range(40):
        clock[0] += {2: 1.0, 1: 1.2}[fake.threads]
        tuner.step(100)
    assert fake.calls == [2, 1, 2, 2] and tuner.chosen == 2 and tuner.passes == 1  # A B B A, verdict


def test_dense_adam_is_torchs_adam_fused_where_torch_has_the_kernel():
    from hps.train import dense_adam
    torch.manual_seed(0)
    fused_model, plain_model = torch.nn.Linear(40, 8), torch.nn.Linear(40, 8)
    plain_model.load_state_dict(fused_model.state_dict())
    start = fused_model.weight.detach().clone()
    fused, plain = dense_adam(fused_model.parameters(), 0.01), torch.optim.Adam(plain_model.parameters(), lr=0.01)
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    assert fused.defaults["fused"] is (True if version >= (2, 4) else None)
    for _ in range(5):
        x = torch.randn(16, 40)
        for model, opt in ((fused_model, fused), (plain_model, plain)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    for a, b in zip(fused_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert (fused_model.weight != start).all()  # the steps moved every weight


def test_a_minibatch_of_consecutive_examples_is_read_as_a_view():
    """A sequential partition's mini-batch (consecutive rows) indexes the batch as a
    slice, a view of its keys: no copy, and the host batch finds the prefetched keys
    where they lie. Any other order stays an index array, so its rows come in that order."""
    from hps.train import _as_slice
    keys = np.arange(40, dtype=np.uint64).reshape(10, 4)
    rows = _as_slice(np.arange(3, 8))
    assert rows == slice(3, 8)
    assert np.shares_memory(keys[rows], keys)
    np.testing.assert_array_equal(keys[rows], keys[np.arange(3, 8)])
    assert _as_slice(np.array([4])) == slice(4, 5)
    for idx in ([0, 2, 1], [2, 1, 0], [0, 1, 1, 3], [5, 7]):  # same ends as a run, or not consecutive
        got = _as_slice(np.array(idx))
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(keys[got], keys[idx])
    empty = _as_slice(np.array([], np.int64))
    assert isinstance(empty, np.ndarray) and len(keys[empty]) == 0


def test_thread_tuner_leaves_the_evaluations_out_of_its_probes(tmp_path, monkeypatch):
    """An evaluation (and a checkpoint) runs between two batches, on the train
    stage's thread: timed, it slowed whichever probe it fell in, and the probes
    compared evaluations, not thread counts. Here every core trains faster (1.0
    against 1.2 clock seconds a batch) and each evaluation costs 30: with
    eval_every = 12 two land in each pass's every-core probes and one in its
    one-fewer probes, and both passes picked one fewer thread."""
    import hps.tuning
    from hps import train as htrain
    clock = [0.0]
    monkeypatch.setattr(hps.tuning, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(htrain, "usable_cpus", lambda: 2)
    step, evaluate = htrain.Trainer.step, htrain.Trainer.evaluate

    def timed_step(self, loaded):
        step(self, loaded)
        clock[0] += {2: 1.0, 1: 1.2}[torch.get_num_threads()]

    def timed_evaluate(self, batches):
        clock[0] += 30.0
        return evaluate(self, batches)
    monkeypatch.setattr(htrain.Trainer, "step", timed_step)
    monkeypatch.setattr(htrain.Trainer, "evaluate", timed_evaluate)
    cfg = config(tmp_path / "ps", eval_every=12)
    cfg.torch_threads = 0
    cfg.data.batch_size, cfg.data.train_examples, cfg.data.eval_examples = 64, 64 * 84, 128
    threads = torch.get_num_threads()
    try:
        got = train(cfg, progress=False)["torch_threads"]
    finally:
        torch.set_num_threads(threads)
    assert got["chosen"] == 2 and got["passes"] == 1
    assert got["examples_per_s"]["2"] == pytest.approx(1.2 * got["examples_per_s"]["1"])


HANG = 60  # seconds: a run still going by then waits for good


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
    assert not t.is_alive(), "still waiting, for good"
    return done[0]


def small_server(path, in_place):
    return hps.ParameterServer(hps.ParameterServerConfig(dim=4, path=str(path), optimizer=hps.SGD(lr=0.5),
                                                         mem_budget="1MiB", host_in_place=in_place))


BATCH_KEYS = np.array([[1, 2], [3, 4]], np.uint64)


def three_batches():
    return [SimpleNamespace(keys=BATCH_KEYS, labels=np.zeros(2, np.float32)) for _ in range(3)]


def push_halves(loaded):
    """Each worker's mini-batch pushes gradients of 1 into the step's batch."""
    for w, idx in enumerate(loaded.minibatches):
        k = loaded.data.keys[idx].reshape(-1)
        loaded.batch.push(k, np.ones((len(k), 4), np.float32), worker=w)


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("pipelined", [True, False])
def test_a_train_steps_call_that_waits_for_its_own_batch_is_refused_and_the_run_goes_on(tmp_path, in_place,
                                                                                         pipelined):
    """The train step's batch is applied on the step's thread once the step
    returns, and written back after: the step's push, batch or checkpoint of
    that server waited for it forever (pipelined or not). Each is refused,
    naming the train step's batch; the run goes on and trains every batch."""
    ps = small_server(tmp_path / "ps", in_place)
    ids = np.unique(BATCH_KEYS)
    before = ps.pull(ids)
    refused = []

    def step(loaded):
        for call in (lambda: ps.push(ids, np.ones((4, 4), np.float32)), lambda: ps.batch(ids).finish(),
                     ps.checkpoint):
            try:
                call()
            except RuntimeError as e:
                refused.append(str(e))
        push_halves(loaded)
    outcome, error = finishes(lambda: hps.pipeline.Pipeline(ps, step).run(three_batches(), pipelined=pipelined))
    assert outcome == "returned", error
    assert len(refused) == 9, refused
    name = "HostBatch" if in_place else "Batch"
    for said, call in zip(refused, ["push", "batch", "checkpoint"] * 3):
        assert said.startswith(f"ParameterServer.{call} "), said
        assert f"the {name} of 4 keys made by batch() is open on this thread, in the pipeline's train step (not " \
               f"yet applied): it is written back only after this thread leaves the pipeline's train step" in said, said
    np.testing.assert_allclose(ps.pull(ids), before - 1.5, rtol=1e-6)  # the three batches' steps alone
    assert ps.checkpoint() == 1 and ps.stats()["mem"]["pinned"] == 0
    ps.close()


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("pipelined", [True, False])
def test_another_threads_push_and_checkpoint_wait_for_the_pipelines_batches_and_go_ahead(tmp_path, in_place,
                                                                                        pipelined):
    """A push or a checkpoint from a thread of its own while the pipeline trains
    (its batches made, trained and written back by the pipeline's threads)
    waits for the batches in flight and goes ahead: not refused."""
    ps = small_server(tmp_path / "ps", in_place)
    ids = np.unique(BATCH_KEYS)
    before = ps.pull(ids)
    in_step, go = threading.Event(), threading.Event()

    def step(loaded):
        if not in_step.is_set():
            in_step.set()
            go.wait(HANG)
        push_halves(loaded)
    pipeline = hps.pipeline.Pipeline(ps, step)
    run = []
    runner = threading.Thread(target=lambda: run.append(finishes(lambda: pipeline.run(three_batches(),
                                                                                      pipelined=pipelined))),
                              daemon=True)
    runner.start()
    assert in_step.wait(HANG)
    done = []
    caller = threading.Thread(target=lambda: done.append(finishes(
        lambda: (ps.push(ids, np.ones((4, 4), np.float32)), ps.checkpoint()))), daemon=True)
    caller.start()
    caller.join(0.3)  # (time to reach the wait: had it returned or raised meanwhile, the asserts below say so)
    go.set()
    runner.join(HANG)
    caller.join(HANG)
    assert not runner.is_alive() and not caller.is_alive()
    assert run[0][0] == "returned" and done == [("returned", (None, 1))], (run, done)
    np.testing.assert_allclose(ps.pull(ids), before - 2.0, rtol=1e-6)  # three batches and the push
    ps.close()
