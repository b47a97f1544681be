"""Serving and operations on a job directory (docs/serving.md): `hps inspect`,
`hps export`, hps.Lookup and `hps serve`, on real small jobs (`hps train` of 10
batches of 128 examples, alone and under mpiexec -n 2) and corrupted copies."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch", reason="the jobs are made by hps train, which needs torch")
import hps  # noqa: E402
from hps import jobdir  # noqa: E402
from hps.cli import main  # noqa: E402

VOCAB = [50, 200, 1000, 5000] + [300] * 22
BATCH, BATCHES = 128, 10

TOML = """
hidden = [8]
torch_threads = 1
checkpoint_every = {every}

[ps]
dim = 4
path = "{path}"
mem_budget = "512KiB"      # rows move to SSD-PS all the time
write_buffer_rows = 256

[ps.ssd]
file_records = 256         # small files of two rows blocks, compacted often
compaction_trigger = 1.2

[ps.optimizer]
kind = "adagrad"
lr = 0.05

[data]
batch_size = {batch}
train_examples = {examples}
eval_examples = 128
vocab_sizes = {vocab}

[distributed]
timeout = 60
"""


def write_config(tmp, name, path, every=2, examples=BATCH * BATCHES, seed=0):
    cfg = tmp / f"{name}.toml"
    text = TOML.format(path=path, every=every, batch=BATCH, examples=examples, vocab=VOCAB)
    cfg.write_text(text.replace("[data]\n", f"[data]\nseed = {seed}\n"))
    return cfg


def train(tmp, name, **kw):
    path = tmp / name
    assert main(["train", "--config", str(write_config(tmp, name, path, **kw)), "--no-progress"]) == 0
    return path


def train_mpi(tmp, name, n=2, **kw):
    path = tmp / name
    cfg = write_config(tmp, name, path, **kw)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    p = subprocess.run([shutil.which("mpiexec"), "-n", str(n), sys.executable, "-m", "hps.cli", "train",
                        "--config", str(cfg), "--no-progress"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return path


def trained_keys(seed=0, examples=BATCH * BATCHES):
    return np.unique(np.concatenate([b.keys.ravel() for b in hps.data.SyntheticCriteo(
        seed=seed, batch_size=BATCH, examples=examples, vocab_sizes=VOCAB)]))


def server_rows(path, keys):
    """Rows of keys read through a ParameterServer opened on a copy of path (an
    independent reader of the checkpoint), and the keys it stores."""
    copy = str(path) + ".ps-copy"
    shutil.copytree(path, copy)
    ps = hps.ParameterServer.open(copy)
    try:
        return ps.pull(keys), ps.stats()["ssd"]["live_records"]
    finally:
        ps.close()
        shutil.rmtree(copy)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return train(tmp_path_factory.mktemp("single"), "job")


@pytest.fixture(scope="module")
def mpi_job(tmp_path_factory):
    pytest.importorskip("mpi4py", reason="an MPI job needs mpi4py")
    if shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec on PATH (pip install mpich)")
    return train_mpi(tmp_path_factory.mktemp("mpi"), "job")


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


# ---------------------------------------------------------------- hps inspect

def test_inspect_reports_what_the_job_holds(job, capsys):
    report = jobdir.inspect(job)
    _, live = server_rows(job, trained_keys()[:1])
    assert report["kind"] == "parameter server" and report["world"] == 1
    assert report["checkpoint"] == 6 and report["step"] == BATCHES  # every 2 batches, and one at the end
    assert report["rows"] == live > 0
    assert report["format"]["parameter_server"] == 2 and report["row_bytes"] == 4 * (4 + 4)  # AdaGrad: w, h
    rank = report["ranks"][0]
    assert rank["checkpoints"] == [6] and rank["param_file_versions"] == {"2": rank["files"]}
    assert rank["records"] >= rank["rows"] and rank["dense_state"]
    assert report["disk_bytes"] > 0 and report["exports"] == {} and "verify" not in report
    assert not os.path.exists(job / jobdir.READERS)  # the private view is gone
    assert main(["inspect", str(job), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == live


def test_inspect_of_an_mpi_job_counts_every_rank(mpi_job):
    report = jobdir.inspect(mpi_job, verify=True)
    assert report["kind"] == "job" and report["world"] == 2 and report["step"] == BATCHES
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert all(r["rows"] > 0 for r in report["ranks"])
    assert report["rows"] == sum(r["rows"] for r in report["ranks"])
    # each rank owns its keys: together they hold the keys a single-process run trains
    assert report["rows"] == len(trained_keys())
    assert report["verify"]["ok"] and report["verify"]["files_checked"] == sum(r["files"] for r in report["ranks"])


def test_verify_names_each_corrupted_file_and_block(job, tmp_path, capsys):
    copy = tmp_path / "job"
    shutil.copytree(job, copy)
    assert main(["inspect", str(copy), "--verify"]) == 0
    assert "all sound" in capsys.readouterr().out
    store = copy / "checkpoints" / "000006" / "ssd"
    files = sorted(p for p in os.listdir(store) if p.endswith(".hpf"))
    # a flipped byte in the second rows block of one file, in the keys of another
    big = [f for f in files if jobdir.read_header(store / f)["records"] * 32 > 4096]  # two rows blocks
    rows_file, keys_file = store / big[0], store / next(f for f in files if f != big[0])
    h = jobdir.read_header(rows_file)
    up = lambda n: -(-n // 4096) * 4096  # noqa: E731
    rows_offset = 4096 + up(h["records"] * 8) + up(up(h["records"] * h["row_bytes"]) // 4096 * 4)
    flip(rows_file, rows_offset + 4096 + 5)
    flip(keys_file, 4096 + 3)
    assert main(["inspect", str(copy), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "2 problem(s)" in out
    assert f"{rows_file}: not a valid hps parameter file: rows block 1 (file offset {rows_offset + 4096}) " \
           f"CRC mismatch" in out
    assert f"{keys_file}: not a valid hps parameter file: keys CRC mismatch" in out
    assert jobdir.READERS not in out  # the checkpoint's paths, not the private copy's


def test_verify_names_a_damaged_manifest(job, tmp_path):
    copy = tmp_path / "job"
    shutil.copytree(job, copy)
    manifest = copy / "checkpoints" / "000006" / "ssd" / "MANIFEST"
    flip(manifest, 12)  # inside the first record's payload, sound records follow
    report = jobdir.inspect(copy, verify=True)
    assert not report["verify"]["ok"]
    assert any(p.startswith(f"rank 0 checkpoint 6: {manifest}: record at byte 0") and "damaged" in p
               for p in report["verify"]["problems"]), report["verify"]["problems"]


def test_inspect_refuses_a_path_that_holds_no_job(tmp_path, capsys):
    (tmp_path / "other").mkdir()
    assert main(["inspect", str(tmp_path / "other")]) == 2
    assert "holds no hps job or parameter server" in capsys.readouterr().err
