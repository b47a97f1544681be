"""`hps train` under failures: killed (SIGKILL) at random moments, a full disk,
and runs that fail before their first checkpoint. A run resumed with --resume
ends with exactly the parameters (every embedding row, the MLP and its
optimizer, bit for bit) of an uninterrupted run over the same data.

The runs are small: 30 batches of 256 examples, a checkpoint every 3 batches,
a MEM-PS budget that holds a few batches (rows go through SSD-PS all the time)
and small parameter files with a low compaction trigger (compactions follow
most checkpoints), so a kill lands mid-batch, mid-checkpoint or mid-compaction.
"""
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install torch)")
import hps  # noqa: E402
from hps.cli import main  # noqa: E402
from hps.train import load_trainer_state, stored_checkpoint  # noqa: E402

VOCAB = [50, 200, 1000, 50_000] + [3000] * 22
BATCH, BATCHES, EVERY = 256, 30, 3

TOML = """
hidden = [16]
dense_lr = 0.01
torch_threads = 1          # runs compared bit for bit must sum in the same order
checkpoint_every = {every}

[ps]
dim = 4
path = "{path}"
mem_budget = "1536KiB"     # two or three batches' rows: the others live in SSD-PS
write_buffer_rows = 256

[ps.ssd]
file_records = 256         # small files, compacted often
compaction_trigger = 1.2

[ps.optimizer]
kind = "adagrad"
lr = 0.05

[data]
source = "{source}"
batch_size = {batch}
train_examples = {examples}
eval_examples = 512
{vocab}"""


def write_config(tmp_path, name, path, source="synthetic", every=EVERY, examples=BATCH * BATCHES):
    cfg = tmp_path / f"{name}.toml"
    # (vocab_sizes describes synthetic data: refused beside a files source)
    vocab = f"vocab_sizes = {VOCAB}\n" if source == "synthetic" else ""
    cfg.write_text(TOML.format(path=path, source=source, every=every, batch=BATCH, examples=examples,
                               vocab=vocab))
    return cfg


def command(config, *flags):
    return [sys.executable, "-m", "hps.cli", "train", "--config", str(config), "--no-progress", *flags]


def parameters(path):
    """Every trained key's row (read through the server opened on path) and the dense state."""
    keys = np.unique(np.concatenate([b.keys.ravel() for b in hps.data.SyntheticCriteo(
        batch_size=BATCH, examples=BATCH * BATCHES, vocab_sizes=VOCAB)]))
    ps = hps.ParameterServer.open(path)
    try:
        rows = ps.pull(keys)
    finally:
        ps.close()
    state = load_trainer_state(path)
    return {"rows": rows, "mlp": state["mlp"], "opt": state["opt"], "batches": state["batches_done"]}


def assert_same(got, want):
    assert got["batches"] == want["batches"] == BATCHES
    np.testing.assert_array_equal(got["rows"], want["rows"])
    for name, value in want["mlp"].items():
        assert torch.equal(got["mlp"][name], value), name
    for index, state in want["opt"]["state"].items():
        for name, value in state.items():
            assert torch.equal(got["opt"]["state"][index][name], value), (index, name)


def checkpoint_after(path, child, at_least=1, timeout=120.0):
    """Waits until the run at path has finished checkpoint `at_least` (or ended);
    the number reached, or None if the child ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        number = stored_checkpoint(str(path))[1]
        if number is not None and number >= at_least:
            return number
        if child.poll() is not None:
            return None
        time.sleep(0.005)
    child.kill()
    pytest.fail(f"{path}: no checkpoint {at_least} after {timeout} s")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run: its parameters, and how long it trained after its
    first checkpoint."""
    tmp = tmp_path_factory.mktemp("straight")
    cfg = write_config(tmp, "straight", tmp / "ps")
    child = subprocess.Popen(command(cfg), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert checkpoint_after(tmp / "ps", child) == 1
    t0 = time.monotonic()
    out, err = child.communicate(timeout=300)
    seconds = time.monotonic() - t0
    assert child.returncode == 0, err[-3000:]
    summary = json.loads((tmp / "ps" / "train-summary.json").read_text())
    # The setting does what the module docstring says: rows went through SSD-PS and compactions ran.
    assert summary["ps"]["counts"]["ssd_hits"] > 0 and summary["ps"]["mem"]["dirty_evictions"] > 0
    assert summary["ps"]["ssd"]["compactions"] > 0, summary["ps"]["ssd"]
    return {"params": parameters(tmp / "ps"), "seconds": seconds}


DIE_IN_CHECKPOINT = textwrap.dedent("""
    import os, signal, sys
    from hps.cli import main
    from hps.parameter_server import ParameterServer
    at = int(sys.argv[2])
    snapshot = ParameterServer._snapshot_store

    def dying(ps, dst):  # checkpoint `at` dies after the store's commit, in its snapshot
        if (ps.checkpoint_number or 0) + 1 == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return snapshot(ps, dst)

    ParameterServer._snapshot_store = dying
    sys.exit(main(["train", "--config", sys.argv[1], "--no-progress"]))
""")


def test_sigkill_at_random_moments_then_resume_ends_as_the_uninterrupted_run(tmp_path, straight):
    """Point 0 dies as soon as its parameter server exists (before the first
    checkpoint: the rerun with --resume starts over); point 1 in the middle of
    a checkpoint (chosen at random), after the store's commit, the moment that
    needs the previous checkpoint; the others at a random moment after the
    first checkpoint. The resumed runs of points 1-3 die again, at random,
    half the time."""
    rng = random.Random(14)
    for point in range(4):
        path = tmp_path / f"run{point}"
        cfg = write_config(tmp_path, f"run{point}", path)
        if point == 1:
            at = rng.randint(2, BATCHES // EVERY)
            child = subprocess.Popen([sys.executable, "-c", DIE_IN_CHECKPOINT, str(cfg), str(at)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            child.communicate(timeout=300)
            assert child.returncode == -signal.SIGKILL
            assert stored_checkpoint(str(path)) == (True, at - 1)
        else:
            child = subprocess.Popen(command(cfg), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if point == 0:
                while not (path / hps.parameter_server.METADATA).exists():
                    assert child.poll() is None and time.sleep(0.002) is None
            else:
                assert checkpoint_after(path, child) is not None
                time.sleep(rng.uniform(0, 0.9) * straight["seconds"])
            child.send_signal(signal.SIGKILL)
            child.communicate()
        if point == 0:
            assert stored_checkpoint(str(path)) == (True, None)
        kills = 1
        while True:
            child = subprocess.Popen(command(cfg, "--resume"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
            if point and kills < 3 and rng.random() < 0.5:
                try:
                    child.communicate(timeout=rng.uniform(0.5, 1.0) * straight["seconds"] + 3.0)
                except subprocess.TimeoutExpired:
                    child.send_signal(signal.SIGKILL)
                    child.communicate()
                    kills += 1
                    continue
            else:
                out, err = child.communicate(timeout=300)
                if point == 0:
                    assert "holds a run that ended before its first checkpoint: starting it over" in err, err
            assert child.returncode == 0
            break
        assert_same(parameters(path), straight["params"])


FULL_DISK = textwrap.dedent("""
    import resource, signal, sys
    from hps import train as htrain
    from hps.cli import main
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    limit_at = int(sys.argv[2])
    original = htrain._train_source

    def limited(cfg, rank=0, world=1):
        # When the reader reaches batch limit_at, no file may grow past 12000 bytes
        # (a parameter file here is 16 KiB): the disk is full from then on.
        for i, b in enumerate(original(cfg, rank, world)):
            if i == limit_at:
                resource.setrlimit(resource.RLIMIT_FSIZE, (12000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            yield b

    htrain._train_source = limited
    sys.exit(main(["train", "--config", sys.argv[1], "--no-progress"]))
""")


DIE_BEFORE_RENAME = textwrap.dedent("""
    import json, os, signal, sys
    from hps import parameter_server as server, train as htrain
    from hps.cli import main
    name, checkpoint = sys.argv[2], sys.argv[3]

    def dying(replace):
        def replace_or_die(src, dst):  # killed between the write aside and the rename
            if os.path.basename(dst) == name and (checkpoint == "any" or
                                                  json.dumps(json.load(open(src))["checkpoint"]) == checkpoint):
                os.kill(os.getpid(), signal.SIGKILL)
            replace(src, dst)
        return replace_or_die

    server._replace_durable = dying(server._replace_durable)
    htrain._replace_durable = dying(htrain._replace_durable)
    sys.exit(main(["train", "--config", sys.argv[1], "--no-progress"]))
""")


@pytest.mark.parametrize("name, checkpoint, rerun", [
    ("hps-parameter-server.json", "null", []),  # the new server's first metadata
    ("hps-parameter-server.json", "1", []),  # the first checkpoint's commit: the rerun starts over
    ("train-summary.json", "any", ["--resume"]),  # the summary of a run that finished its data
], ids=["first-metadata", "first-checkpoint", "summary"])
def test_what_a_kill_leaves_written_aside_is_removed_by_the_next_run(tmp_path, name, checkpoint, rerun):
    # A file written aside and renamed over (the metadata, the run's summary) stays as
    # NAME.tmp when the run is killed in between. A discarded run's removal and the
    # server's check of a new path knew nothing of them: the new server refused its
    # path ("not empty and holds no parameter server") for good, and so did the rerun
    # that starts over a run that never checkpointed; a finished run's summary.tmp
    # stayed for good. The next run at the path now removes them.
    path = tmp_path / "ps"
    cfg = write_config(tmp_path, "run", path, every=2, examples=BATCH * 4)
    killed = subprocess.run([sys.executable, "-c", DIE_BEFORE_RENAME, str(cfg), name, checkpoint],
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (path / f"{name}.tmp").exists()
    again = subprocess.run(command(cfg, *rerun), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not list(path.rglob("*.tmp")), sorted(path.rglob("*.tmp"))
    assert load_trainer_state(str(path))["batches_done"] == 4


def test_a_discarded_run_leaves_nothing_it_wrote_aside(tmp_path):
    # An MPI job that never checkpointed is started over rank by rank (_discard_run),
    # and a rank's directory left with anything in it kept the job's directory "not
    # empty": the rerun was refused for good where a rank had been killed between
    # writing its metadata (or summary) aside and the rename.
    from hps.train import METADATA, SUMMARY, _discard_run
    (tmp_path / "checkpoints").mkdir()
    for name in (METADATA, METADATA + ".tmp", SUMMARY + ".tmp"):
        (tmp_path / name).write_text("{}")
    _discard_run(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="needs POSIX resource limits")
def test_a_full_disk_fails_naming_the_file_and_resume_ends_as_the_uninterrupted_run(tmp_path, straight):
    path = tmp_path / "ps"
    cfg = write_config(tmp_path, "full", path)
    # Batch 10 is read after the checkpoint of batch 9 (the third) finished.
    run = subprocess.run([sys.executable, "-c", FULL_DISK, str(cfg), "10"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 1, run.stderr[-3000:]
    error = [line for line in run.stderr.splitlines() if line.startswith("hps train:")]
    assert error and "File too large" in error[0] and str(path) in error[0], run.stderr[-3000:]
    assert "run again with --resume" in run.stderr
    assert stored_checkpoint(str(path)) == (True, 3)
    assert load_trainer_state(str(path))["batches_done"] == 9
    resumed = subprocess.run(command(cfg, "--resume"), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same(parameters(path), straight["params"])


def tsv_lines(n, seed=3):
    """n lines of Criteo TSV (label, 13 integers, 26 hex ids)."""
    rng = np.random.default_rng(seed)
    return [f"{rng.integers(0, 2)}\t" + "\t".join(str(v) for v in rng.integers(0, 50, 13)) + "\t" +
            "\t".join(f"{v:08x}" for v in rng.integers(0, 3000, 26)) for _ in range(n)]


def test_a_bad_data_path_creates_nothing(tmp_path, capsys):
    path = tmp_path / "ps"
    cfg = write_config(tmp_path, "bad", path, source=tmp_path / "no-such-dir" / "*.tsv")
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 2
    assert "no data file in" in capsys.readouterr().err
    assert not path.exists()
    assert main(["train", "--config", str(cfg), "--no-progress", "--resume"]) == 2
    assert not path.exists()


def test_a_bad_ps_setting_is_named_with_its_file_and_creates_nothing(tmp_path, capsys):
    path = tmp_path / "ps"
    cfg = write_config(tmp_path, "typo", path)
    cfg.write_text(cfg.read_text().replace("write_buffer_rows = 256", 'schedule = "herlad"'))
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 2
    assert f"{cfg}: [ps]: schedule must be 'sequential' or 'herald', got 'herlad'" in capsys.readouterr().err
    assert not path.exists()


@pytest.mark.parametrize("rerun", ["plain", "--resume"])
def test_a_malformed_line_before_the_first_checkpoint_lets_the_rerun_start_over(tmp_path, capsys, rerun):
    # hps train reads its data's first example before it writes anything: a bad line
    # in the block that holds it fails there, so the bad line is in a second file.
    lines = tsv_lines(6 * BATCH)
    lines[4 * BATCH + 7] = "1\tnot-a-number" + lines[4 * BATCH + 7][1:]
    data = tmp_path / "day"
    data.mkdir()
    first, second = data / "part-0.tsv", data / "part-1.tsv"
    first.write_text("\n".join(lines[:4 * BATCH]) + "\n")
    second.write_text("\n".join(lines[4 * BATCH:]) + "\n")
    path = tmp_path / "ps"
    cfg = write_config(tmp_path, "tsv", path, source=data, every=5)
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{second}:8" in err, err
    assert stored_checkpoint(str(path)) == (True, None)  # it failed in batch 4, before the first checkpoint
    second.write_text("\n".join(tsv_lines(6 * BATCH)[4 * BATCH:]) + "\n")  # the data fixed
    flags = ["--resume"] if rerun == "--resume" else []
    assert main(["train", "--config", str(cfg), "--no-progress", *flags]) == 0
    err = capsys.readouterr().err
    assert f"{path} holds a run that ended before its first checkpoint: starting it over from batch 0" in err, err
    summary = json.loads((path / "train-summary.json").read_text())
    assert summary["batches"] == 6 and summary["examples"] == 6 * BATCH
    # The same as a run on the fixed data from the start.
    fresh = tmp_path / "fresh"
    assert main(["train", "--config", str(write_config(tmp_path, "fresh", fresh, source=data, every=5)),
                 "--no-progress"]) == 0
    for name, value in load_trainer_state(str(fresh))["mlp"].items():
        assert torch.equal(load_trainer_state(str(path))["mlp"][name], value), name


def test_a_server_of_an_older_format_is_refused_not_started_over(tmp_path, capsys):
    """Format 1 kept no "checkpoint" field: its server must not pass for one
    that never finished a checkpoint, whose files a rerun removes."""
    path = tmp_path / "ps"
    (path / "ssd").mkdir(parents=True)
    (path / "ssd" / "000000000001.hpf").write_bytes(b"rows")
    (path / hps.parameter_server.METADATA).write_text(json.dumps({"format": 1, "checkpoints": 3, "config": {}}))
    cfg = write_config(tmp_path, "old", path)
    for flags in ([], ["--resume"]):
        assert main(["train", "--config", str(cfg), "--no-progress", *flags]) == 2
        assert "format 1, this build reads 2" in capsys.readouterr().err
        assert (path / "ssd" / "000000000001.hpf").read_bytes() == b"rows"


def test_a_diverged_run_stops_before_a_nan_reaches_the_job(tmp_path, capsys):
    """A learning rate far too high: the loss turns NaN or infinite in a few batches.
    The run went on to the end, wrote NaN rows and weights into its checkpoints and
    exited 0 with an eval AUC ranked from NaN scores. Now the batch whose loss is not
    a number stops it (exit 1, naming the batch and the rates) before its gradients
    reach any row or weight, and the last finished checkpoint holds numbers only."""
    path = tmp_path / "ps"
    cfg = write_config(tmp_path, "hot", path, every=1)
    cfg.write_text(cfg.read_text().replace("dense_lr = 0.01", "dense_lr = 1e30").replace("lr = 0.05", "lr = 1e30"))
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"hps train: DivergedError: batch (\d+): the loss is (nan|inf) \(worker 0\): training diverged "
                     r"\(a learning rate too high\? dense_lr = 1e\+30, \[ps.optimizer\] lr = 1e\+30\)", err), err
    assert "the last finished checkpoint is intact" in err
    checkpointed = load_trainer_state(str(path))["batches_done"]
    assert 1 <= checkpointed < BATCHES  # a checkpoint after the first batch, none after the NaN
    state = parameters(str(path))
    assert np.isfinite(state["rows"]).all()
    assert all(torch.isfinite(v).all() for v in state["mlp"].values())


# Damaged job.json files, with what hps.jobdir.read_job_record names in each.
DAMAGED_JOBS = [
    ("{", "not JSON"),
    ("[2, 1]", "not a job record (a JSON list, not an object)"),
    ('{"checkpoint": 1}', "no field 'world'"),
    ('{"world": "one", "checkpoint": null}', "field 'world' must be a number of ranks >= 1, got 'one'"),
    ('{"world": 2, "checkpoint": "1"}', "field 'checkpoint' must be a checkpoint number or null, got '1'"),
]


def job_files(root):
    """Every file under root with its bytes: what a refused run must leave as it was."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("record,named", DAMAGED_JOBS)
def test_a_damaged_job_json_is_named_and_the_job_left_as_it_was(tmp_path, capsys, record, named):
    """One process given a job's directory whose job.json is damaged: the trainer
    parsed it itself, so a list or a missing world ended in a bare TypeError or
    KeyError (a traceback, exit 1), not JSON in json's message without the file,
    a world "one" was told to run under ``mpiexec -n one`` and a checkpoint "1"
    (without --resume) under ``mpiexec -n 2``. It now reads it with
    hps.jobdir.read_job_record: exit 2 naming the file and the field, with nothing
    of the job changed."""
    path = tmp_path / "ps"
    (path / "rank0").mkdir(parents=True)
    (path / "rank0" / "marker").write_text("the rank's files")
    (path / "job.json").write_text(record)
    before = job_files(path)
    cfg = write_config(tmp_path, "damaged", path)
    for flags in (["--resume"], []):
        assert main(["train", "--config", str(cfg), "--no-progress", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert f"hps train: {path / 'job.json'}: {named}" in err, (flags, err)
        assert job_files(path) == before, flags
