"""Admission (hps.admission, [admission] in hps train): the sketch against exact counts,
the default row that never trains, rows only for keys seen f times, counters that match
an independent count, an exact resume, threshold 1 as no admission at all, config errors."""
from __future__ import annotations

import numpy as np
import pytest

import hps
from hps.admission import ADMISSION_DEFAULT_KEY, Admission, AdmissionSketch
from hps.data.keys import SENTINEL_KEY

torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install torch)")
from hps.train import TrainConfig, load_trainer_state, train  # noqa: E402

VOCAB = [50, 200, 1000, 4000] + [3000] * 22
BATCH, BATCHES, F = 256, 12, 3
DEFAULT = np.uint64(ADMISSION_DEFAULT_KEY)


def zipf_stream(n, universe, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.zipf(1.2, n) % universe).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)


def test_default_key_is_reserved_apart():
    assert ADMISSION_DEFAULT_KEY not in (SENTINEL_KEY, 0xFFFF_FFFF_FFFF_FFFE)
    assert hps.ADMISSION_DEFAULT_KEY == ADMISSION_DEFAULT_KEY and hps.AdmissionSketch is AdmissionSketch


def test_sketch_against_exact_counts_on_a_zipf_stream():
    big = AdmissionSketch(threshold=4, bytes="4MiB")
    small = AdmissionSketch(threshold=4, bytes="2KiB")  # 4 x 512 counters for thousands of keys
    keys = zipf_stream(200_000, 20_000)
    counts: dict = {}
    for batch in np.array_split(keys, 50):
        got = big.admit(batch)
        small.admit(batch)
        u, c = np.unique(batch, return_counts=True)
        for k, n in zip(u.tolist(), c.tolist()):
            counts[k] = counts.get(k, 0) + n
        want = np.array([counts[k] >= 4 for k in batch.tolist()])
        np.testing.assert_array_equal(got, want)  # a large sketch is exact here
    u = np.array(list(counts), dtype=np.uint64)
    truth = np.minimum(np.array(list(counts.values())), 255)
    np.testing.assert_array_equal(big.estimate(u), truth)
    est = small.estimate(u)
    assert (est >= truth).all() and (est > truth).any()
    assert big.occurrences == len(keys) and big.keys_admitted == int((truth >= 4).sum())
    # query counts nothing; a restored sketch answers the same
    before = big.counters()
    np.testing.assert_array_equal(big.query(u), truth >= 4)
    np.testing.assert_array_equal(big.counters(), before)
    again = AdmissionSketch(threshold=4, bytes="4MiB")
    again.load_state_dict(big.state_dict())
    np.testing.assert_array_equal(again.estimate(u), truth)
    with pytest.raises(ValueError, match="threshold = 4, this one 5"):
        AdmissionSketch(threshold=5, bytes="4MiB").load_state_dict(big.state_dict())


def test_sketch_rejects_bad_arguments():
    for kw, name in ((dict(threshold=0), "threshold"), (dict(threshold=256), "threshold"),
                     (dict(threshold=2, bytes=0), "bytes"), (dict(threshold=2, rows=0), "rows")):
        with pytest.raises(ValueError, match=name):
            AdmissionSketch(**kw)
    with pytest.raises(TypeError, match="uint64 or int64"):
        AdmissionSketch(threshold=2).admit(np.zeros(3, np.float32))


@pytest.mark.parametrize("opt", [hps.SGD(lr=0.1), hps.AdaGrad(lr=0.1), hps.Adam(lr=0.1)], ids=lambda o: o.kind)
def test_a_zero_gradient_leaves_a_row_unchanged(tmp_path, opt):
    ps = hps.ParameterServer(hps.ParameterServerConfig(dim=4, path=str(tmp_path / "ps"), optimizer=opt))
    try:
        keys = np.array([DEFAULT, 7], dtype=np.uint64)
        first = ps.pull(keys)
        for _ in range(3):  # Adam: m and v stay 0, so every step is 0
            ps.push(keys, np.array([[0.0] * 4, [0.5] * 4], np.float32))
        after = ps.pull(keys)
    finally:
        ps.close()
    np.testing.assert_array_equal(after[0], first[0])
    assert not np.array_equal(after[1], first[1])


def config(path, threshold=None, examples=BATCH * BATCHES, checkpoint_every=0, eval_every=0, pipelined=False,
           lookahead=0, **extra):
    d = {"hidden": [8], "dense_lr": 0.01, "torch_threads": 1, "pipelined": pipelined, "seed": 1,
         "checkpoint_every": checkpoint_every, "eval_every": eval_every,
         "ps": {"dim": 4, "path": str(path), "mem_budget": "64MiB", "optimizer": {"kind": "adagrad", "lr": 0.05},
                "lookahead": lookahead},
         "data": {"source": "synthetic", "batch_size": BATCH, "train_examples": examples, "eval_examples": 1024,
                  "vocab_sizes": VOCAB}}
    if threshold is not None:
        d["admission"] = {"threshold": threshold, **extra}
    return TrainConfig.from_dict(d)


def train_keys(examples=BATCH * BATCHES):
    return [b.keys for b in hps.data.SyntheticCriteo(batch_size=BATCH, examples=examples, vocab_sizes=VOCAB)]


def pull(path, keys):
    ps = hps.ParameterServer.open(str(path))
    try:
        return ps.pull(np.asarray(keys, np.uint64)), ps.stats()
    finally:
        ps.close()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    path = tmp_path_factory.mktemp("adm") / "ps"
    return path, train(config(path, F, checkpoint_every=4), progress=False)


def test_training_admits_keys_at_the_threshold(straight, tmp_path):
    path, summary = straight
    # An independent count over the same batches: a key is admitted in the batch
    # that takes its count to F, for all its occurrences there.
    counts: dict = {}
    defaults = 0
    for keys in train_keys():
        u, c = np.unique(keys, return_counts=True)
        for k, n in zip(u.tolist(), c.tolist()):
            counts[k] = counts.get(k, 0) + n
        defaults += sum(counts[k] < F for k in keys.ravel().tolist())
    admitted = sorted(k for k, n in counts.items() if n >= F)
    rare = sorted(k for k, n in counts.items() if n < F)
    assert rare and admitted
    a = summary["admission"]
    assert a["threshold"] == F and a["sketch_bytes"] == 4 << 20
    assert a["occurrences_counted"] == BATCH * BATCHES * 26
    assert a["default_reads"] == a["dropped_gradients"] == defaults
    assert a["keys_admitted"] == len(admitted)
    assert 0 < a["eval_default_reads"] < a["eval_reads"] == 1024 * 26
    # Rows: the admitted keys and the default row, nothing else.
    ps = summary["ps"]
    assert ps["counts"]["initialized"] == len(admitted) + 1
    # The counters in the checkpoint match the independent count.
    state = load_trainer_state(str(path))["admission"]
    sketch = AdmissionSketch(threshold=F)
    sketch.load_state_dict(state["sketch"])
    keys = np.array(list(counts), dtype=np.uint64)
    np.testing.assert_array_equal(sketch.estimate(keys), np.minimum([counts[k] for k in counts.keys()], 255))
    # The default row is the initializer's, untouched by training.
    rows, _ = pull(path, [DEFAULT])
    fresh = hps.ParameterServer(config(tmp_path / "fresh").ps)
    try:
        np.testing.assert_array_equal(rows[0], fresh.pull(np.array([DEFAULT], np.uint64))[0])
    finally:
        fresh.close()
    # Pulling a rare key now has to create its row: it had none.
    _, stats = pull(path, rare[:5])
    assert stats["counts"]["initialized"] == 5


def test_resume_is_exact(straight, tmp_path):
    path, want = straight
    part = tmp_path / "ps"
    train(config(part, F, examples=BATCH * 5, checkpoint_every=4), progress=False)
    got = train(config(part, F, checkpoint_every=4), resume=True, progress=False)
    assert got["batches"] == BATCHES
    for k in ("auc", "logloss"):
        assert got["final"][k] == want["final"][k]
    for k in ("default_reads", "keys_admitted", "occurrences_counted"):
        assert got["admission"][k] == want["admission"][k]
    keys = np.unique(np.concatenate([k.ravel() for k in train_keys()]))[:500]
    np.testing.assert_array_equal(pull(part, keys)[0], pull(path, keys)[0])


def test_a_resume_with_another_sketch_size_names_the_field(tmp_path):
    part = tmp_path / "ps"
    train(config(part, F, examples=BATCH * 2, checkpoint_every=2, sketch_bytes="64KiB"), progress=False)
    with pytest.raises(ValueError, match=r"sketch of 65,536 bytes, this run's \[admission\] sketch_bytes gives "
                                         r"131,072; resume with sketch_bytes = 65536"):
        train(config(part, F, checkpoint_every=2, sketch_bytes="128KiB"), resume=True, progress=False)


def test_evaluations_in_a_run_answer_as_the_batches_trained_left_the_sketch(tmp_path, monkeypatch):
    """The read stage counts admission ahead of the batch trained (its queues). An
    evaluation in the middle of a pipelined run answers as the batches trained by
    then left the sketch: its metrics equal those of the run that reads each batch
    only as it trains it, however far the reader has got (here made to be two
    batches ahead at every evaluation), as they do without admission."""
    import threading
    from hps import train as htrain
    batches = 6
    counted = [0]
    cond = threading.Condition()

    def source():
        for b in hps.data.SyntheticCriteo(batch_size=BATCH, examples=BATCH * batches, vocab_sizes=VOCAB):
            yield b
            with cond:  # the reader came back for more: it has counted b
                counted[0] += 1
                cond.notify_all()
        with cond:
            counted[0] = batches
            cond.notify_all()

    evaluate = htrain.Trainer.evaluate

    def evaluate_with_the_reader_ahead(trainer, eval_batches):
        want = min(trainer.batches_done + 2, batches)
        with cond:
            assert cond.wait_for(lambda: counted[0] >= want, timeout=120), "the reader did not read ahead"
        return evaluate(trainer, eval_batches)

    runs = []
    for pipelined in (False, True):
        cfg = config(tmp_path / f"p{pipelined}", F, examples=BATCH * batches)
        cfg.eval_every, cfg.pipelined = 1, pipelined
        if pipelined:
            monkeypatch.setattr(htrain.Trainer, "evaluate", evaluate_with_the_reader_ahead)
        counted[0] = 0
        summary = train(cfg, progress=False, train_batches=source())
        runs.append([(h["batches"], h["auc"], h["logloss"]) for h in summary["history"]])
    assert len(runs[0]) == batches + 1
    assert runs[1] == runs[0]


def test_threshold_one_is_no_admission(tmp_path):
    a = train(config(tmp_path / "a", 1, examples=BATCH * 4), progress=False)
    b = train(config(tmp_path / "b", None, examples=BATCH * 4), progress=False)
    assert a["final"]["auc"] == b["final"]["auc"] and a["final"]["logloss"] == b["final"]["logloss"]
    assert a["admission"] == b["admission"] and a["admission"]["sketch_bytes"] == 0
    assert a["ps"]["counts"]["initialized"] == b["ps"]["counts"]["initialized"]
    keys = np.unique(np.concatenate([k.ravel() for k in train_keys(BATCH * 4)]))[:300]
    np.testing.assert_array_equal(pull(tmp_path / "a", keys)[0], pull(tmp_path / "b", keys)[0])


def test_config_errors_name_the_field(tmp_path):
    for extra, name in (({"threshold": 0}, "admission.threshold"), ({"threshold": 256}, "admission.threshold"),
                        ({"threshold": "3"}, "admission.threshold"),
                        ({"threshold": 2, "sketch_bytes": "lots"}, "admission.sketch_bytes"),
                        ({"threshold": 2, "sketch_bytes": 2}, "admission.sketch_bytes"),
                        ({"threshold": 2, "sketch_bytes": "1000000TiB"}, "admission.sketch_bytes.*machine's memory"),
                        ({"threshold": 2, "bogus": 1}, "admission.bogus")):
        with pytest.raises(ValueError, match=name):
            config(tmp_path / "x", **extra)
    d = {"ps": {"dim": 4, "path": str(tmp_path / "y"), "optimizer": {"kind": "adam", "eps": 0.0}},
         "admission": {"threshold": 2}}
    with pytest.raises(ValueError, match="eps"):
        TrainConfig.from_dict(d)


LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE", "SLURM_STEP_TASKS_PER_NODE",
                      "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_NODEID")


@pytest.fixture
def no_launcher(monkeypatch):
    """No launcher's variables (the tests may run inside a Slurm or MPI job) and a
    machine of 1 MiB."""
    import hps.train
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hps.train, "_physical_memory", lambda: 1 << 20)
    return monkeypatch


@pytest.mark.parametrize("launcher", [{"MPI_LOCALNRANKS": "4", "PMI_SIZE": "8"},
                                      {"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_SIZE": "8"},
                                      {"PMIX_LOCAL_SIZE": "4", "PMIX_SIZE": "8"},
                                      {"SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "1"},
                                      {"SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_TASKS_PER_NODE": "8"},
                                      {"SLURM_NTASKS_PER_NODE": "4"}])
def test_the_sketch_memory_check_counts_the_ranks_on_the_machine(no_launcher, launcher):
    """Every rank allocates the sketch: 4 ranks on this machine with a sketch of
    300 KiB each need 1.2 MiB, more than a machine of 1 MiB holds, though one
    sketch fits. The count comes from whichever launcher's variable says it
    (plain srun and PMIx launchers set none of MPI's), named in the error."""
    from hps.train import AdmissionConfig
    AdmissionConfig(threshold=2, sketch_bytes="300KiB").check()  # one process
    for name, value in launcher.items():
        no_launcher.setenv(name, value)
    told_by = next(name for name in LAUNCHER_VARIABLES if name in launcher)
    with pytest.raises(ValueError, match=r"admission.sketch_bytes = '300KiB' \(307,200 bytes a rank; 4 ranks on "
                                         rf"this machine \({told_by}\) hold 1,228,800 bytes\) is more than this "
                                         r"machine's memory \(1,048,576 bytes\)"):
        AdmissionConfig(threshold=2, sketch_bytes="300KiB").check()
    AdmissionConfig(threshold=2, sketch_bytes="256KiB").check()  # 4 of them fit
    AdmissionConfig(threshold=1, sketch_bytes="300KiB").check()  # threshold 1 keeps no sketch


def test_the_sketch_memory_check_counts_the_evaluations_sketches(no_launcher, tmp_path):
    """With eval_every > 0 a rank holds the live sketch, the evaluation's (a second
    one kept for the rest of the run) and the copies of the counters the read stage
    kept for the evaluations it has counted batches for: a sketch of 400 KiB fits a
    machine of 1 MiB once, not three times."""
    with pytest.raises(ValueError, match=r"admission.sketch_bytes = '400KiB' \(409,600 bytes a sketch; 3 sketches "
                                         r"a rank with eval_every = 20: the live one, the evaluation's, and one kept "
                                         r"for the next evaluation: 1,228,800 bytes\) is more than this machine's "
                                         r"memory \(1,048,576 bytes\)"):
        config(tmp_path / "a", threshold=2, sketch_bytes="400KiB", eval_every=20)
    config(tmp_path / "b", threshold=2, sketch_bytes="400KiB", eval_every=0)  # only at the end: the live one
    config(tmp_path / "c", threshold=2, sketch_bytes="300KiB", eval_every=20)  # 3 of them fit


def test_the_sketch_memory_check_counts_the_copies_of_evaluations_the_read_stage_is_ahead_of(no_launcher, tmp_path):
    """A pipelined run's read stage counts batches up to 9 past the one trained (the
    queues' 4 + 1 + 1 slots, and one held by each of the reader, prefetcher and
    loader), keeping a copy for each evaluation among them: with eval_every = 1,
    ten copies besides the live and evaluation sketches; with eval_every = 5, two."""
    with pytest.raises(ValueError, match=r"\(102,400 bytes a sketch; 12 sketches a rank with eval_every = 1: the live "
                                         r"one, the evaluation's, and 10 kept for the next evaluations, which the "
                                         r"read stage passes up to 9 batches ahead of training: 1,228,800 bytes\)"):
        config(tmp_path / "a", threshold=2, sketch_bytes="100KiB", eval_every=1, pipelined=True)
    config(tmp_path / "b", threshold=2, sketch_bytes="100KiB", eval_every=1, pipelined=False)  # 3 sketches
    with pytest.raises(ValueError, match=r"4 sketches a rank with eval_every = 5: the live one, the evaluation's, "
                                         r"and 2 kept for the next evaluations"):
        config(tmp_path / "c", threshold=2, sketch_bytes="300KiB", eval_every=5, pipelined=True)
    config(tmp_path / "d", threshold=2, sketch_bytes="300KiB", eval_every=10, pipelined=True)  # 3 sketches
    # A lookahead window past the read queue's 4 batches grows it: 16 + 1 + 1 slots and
    # 3 held, 21 batches ahead; not pipelined, the window's 16 (the check counted none).
    with pytest.raises(ValueError, match=r"5 sketches a rank with eval_every = 10: the live one, the evaluation's, "
                                         r"and 3 kept for the next evaluations, which the read stage passes up to "
                                         r"21 batches ahead"):
        config(tmp_path / "e", threshold=2, sketch_bytes="300KiB", eval_every=10, pipelined=True, lookahead=16)
    with pytest.raises(ValueError, match=r"5 sketches a rank with eval_every = 8: the live one, the evaluation's, "
                                         r"and 3 kept for the next evaluations, which the read stage passes up to "
                                         r"16 batches ahead"):
        config(tmp_path / "f", threshold=2, sketch_bytes="300KiB", eval_every=8, pipelined=False, lookahead=16)
    # train() checks again under MPI with its count of the ranks on the machine.
    from hps.train import AdmissionConfig
    with pytest.raises(ValueError, match=r"\(102,400 bytes a sketch; 3 sketches a rank with eval_every = 20: the live "
                                         r"one, the evaluation's, and one kept for the next evaluation: 307,200 "
                                         r"bytes; 4 ranks on this machine \(MPI's shared-memory communicator\) hold "
                                         r"1,228,800 bytes\)"):
        AdmissionConfig(threshold=2, sketch_bytes="100KiB").check_memory(
            "[admission]", (4, "MPI's shared-memory communicator"), eval_every=20, pipelined=False)


def test_the_sketch_memory_check_counts_no_evaluation_sketch_without_held_out_data(no_launcher, tmp_path):
    """Evaluations keep sketches only where there are held-out batches to score:
    files without eval_source have none, and the check refused 400 KiB on a machine
    of 1 MiB as 3 sketches a rank that the run never holds (one)."""
    d = {"eval_every": 20, "pipelined": False, "ps": {"dim": 4, "path": str(tmp_path / "a")},
         "data": {"source": str(tmp_path / "day_0.tsv")}, "admission": {"threshold": 2, "sketch_bytes": "400KiB"}}
    TrainConfig.from_dict(d)
    d["data"]["eval_source"] = str(tmp_path / "day_1.tsv")
    with pytest.raises(ValueError, match=r"3 sketches a rank with eval_every = 20"):
        TrainConfig.from_dict(d)
    d["data"] = {"source": "synthetic", "eval_examples": 0}  # the generator's eval stream, of no example
    TrainConfig.from_dict(d)


class _Reached(Exception):
    pass


class _OneRankJob:
    """A job of one rank on a machine of 4 (MPI's count) that stops train() once it
    asks the ranks for their data's fields, past the memory check."""
    rank, size, machine_ranks = 0, 1, 4

    def allgather(self, channel, value, what, note=None):
        if what == "the data's fields":
            raise _Reached
        return [value]


def test_train_checks_the_sketches_of_the_evaluations_it_runs(no_launcher, tmp_path):
    """train() checks again with the held-out batches it has: none (eval_batches=[])
    keep no evaluation sketch, so 100 KiB a rank on 4 ranks fits 1 MiB once (the
    check under MPI counted 3 sketches a rank and refused); the synthetic eval
    stream's batches do, so an eval_every set after the config was read (as
    --eval-every does) counts them (it was not checked without MPI)."""
    cfg = config(tmp_path / "a", threshold=2, sketch_bytes="100KiB")
    cfg.eval_every = 20
    batches = hps.data.SyntheticCriteo(batch_size=BATCH, examples=BATCH, vocab_sizes=VOCAB)
    with pytest.raises(_Reached):
        train(cfg, progress=False, node=_OneRankJob(), train_batches=batches, eval_batches=[])
    with pytest.raises(ValueError, match=r"3 sketches a rank with eval_every = 20.*4 ranks on this machine "
                                         r"\(MPI's shared-memory communicator\) hold 1,228,800 bytes"):
        train(cfg, progress=False, node=_OneRankJob(), train_batches=batches)
    cfg = config(tmp_path / "b", threshold=2, sketch_bytes="400KiB")
    cfg.eval_every = 20
    with pytest.raises(ValueError, match=r"3 sketches a rank with eval_every = 20: the live one, the evaluation's"):
        train(cfg, progress=False, train_batches=batches)
    assert not (tmp_path / "b").exists()


def test_eval_examples_of_0_read_no_held_out_batch_and_a_negative_count_is_refused(no_launcher, tmp_path):
    """data.eval_examples = 0 means no held-out examples for files as for synthetic
    data: _eval_batches read one batch of eval_source before it looked at the count,
    and the sketch check counted evaluation sketches for a run that scores none. A
    negative count was taken as it came."""
    from hps.train import _eval_batches
    tsv, held = tmp_path / "day_0.tsv", tmp_path / "day_1.tsv"
    row = "\t".join(["1"] + ["1"] * 13 + ["68fd1e64"] * 26)
    tsv.write_text((row + "\n") * 8)
    held.write_text((row + "\n") * 8)
    d = {"eval_every": 20, "pipelined": False, "ps": {"dim": 4, "path": str(tmp_path / "a")},
         "data": {"source": str(tsv), "eval_source": str(held), "batch_size": 4},
         "admission": {"threshold": 2, "sketch_bytes": "400KiB"}}
    with pytest.raises(ValueError, match="3 sketches a rank"):  # 1 MiB machine (no_launcher)
        TrainConfig.from_dict(d)
    d["data"]["eval_examples"] = 0
    cfg = TrainConfig.from_dict(d)
    assert _eval_batches(cfg) == []
    # Files give exactly the count asked, the batch that crosses it cut short (synthetic data's
    # eval stream always did; files gave whole batches: 8 examples scored for 5).
    d["data"]["eval_examples"] = 5
    assert [len(b) for b in _eval_batches(TrainConfig.from_dict({**d, "admission": {}}))] == [4, 1]
    d["data"]["eval_examples"] = 3
    assert [len(b) for b in _eval_batches(TrainConfig.from_dict({**d, "admission": {}}))] == [3]
    d["data"]["eval_examples"] = 8
    assert [len(b) for b in _eval_batches(TrainConfig.from_dict({**d, "admission": {}}))] == [4, 4]
    d["data"]["eval_examples"] = -1
    with pytest.raises(ValueError, match=r"data.eval_examples must be an int >= 0, got -1"):
        TrainConfig.from_dict(d)


def test_the_ranks_on_the_machine_as_each_launcher_writes_them():
    from hps.distributed.comm import local_ranks_from_environment as ranks
    assert ranks({}) == (1, "")
    assert ranks({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}) == (3, "OMPI_COMM_WORLD_LOCAL_SIZE")
    assert ranks({"MPI_LOCALNRANKS": "5"}) == (5, "MPI_LOCALNRANKS")
    assert ranks({"PMIX_LOCAL_SIZE": "2"}) == (2, "PMIX_LOCAL_SIZE")
    assert ranks({"SLURM_NTASKS_PER_NODE": "6", "SLURM_NODEID": "3"}) == (6, "SLURM_NTASKS_PER_NODE")
    # Slurm's layout: this machine's entry is the one at SLURM_NODEID (the first without it).
    layout = "4(x2),3"
    assert [ranks({"SLURM_TASKS_PER_NODE": layout, "SLURM_NODEID": str(n)})[0] for n in range(3)] == [4, 4, 3]
    assert ranks({"SLURM_TASKS_PER_NODE": layout}) == (4, "SLURM_TASKS_PER_NODE")
    assert ranks({"SLURM_TASKS_PER_NODE": "2,1(x3),7", "SLURM_NODEID": "4"}) == (7, "SLURM_TASKS_PER_NODE")
    # The step's layout before the job's, the job's before --ntasks-per-node; an
    # mpiexec's own count before Slurm's (an mpiexec inside a Slurm job).
    assert ranks({"SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "8"}) == (2, "SLURM_STEP_TASKS_PER_NODE")
    assert ranks({"SLURM_TASKS_PER_NODE": "3", "SLURM_NTASKS_PER_NODE": "8"}) == (3, "SLURM_TASKS_PER_NODE")
    assert ranks({"MPI_LOCALNRANKS": "2", "SLURM_TASKS_PER_NODE": "8"}) == (2, "MPI_LOCALNRANKS")


@pytest.mark.parametrize("env,message", [
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "four"}, "OMPI_COMM_WORLD_LOCAL_SIZE = 'four' is not a number of ranks"),
    ({"MPI_LOCALNRANKS": "0"}, "MPI_LOCALNRANKS = '0' is not a number of ranks"),
    ({"PMIX_LOCAL_SIZE": ""}, "PMIX_LOCAL_SIZE = '' is not a number of ranks"),
    ({"SLURM_NTASKS_PER_NODE": "-2"}, "SLURM_NTASKS_PER_NODE = '-2' is not a number of ranks"),
    ({"SLURM_TASKS_PER_NODE": "4(x2"}, r"SLURM_TASKS_PER_NODE = '4\(x2': '4\(x2' is not a task count"),
    ({"SLURM_TASKS_PER_NODE": "4(y2)"}, r"SLURM_TASKS_PER_NODE = '4\(y2\)': '4\(y2\)' is not a task count"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2,,1"}, r"SLURM_STEP_TASKS_PER_NODE = '2,,1': '' is not a task count"),
    ({"SLURM_TASKS_PER_NODE": "4(x0)"}, r"'4\(x0\)' is not a task count"),
    ({"SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "3"},
     r"SLURM_TASKS_PER_NODE = '4\(x2\),3' lists 3 node\(s\), and this is node 3 \(SLURM_NODEID\)"),
    ({"SLURM_TASKS_PER_NODE": "4", "SLURM_NODEID": "first"}, "SLURM_NODEID = 'first' is not a node number")])
def test_a_launcher_variable_no_launcher_writes_is_named(env, message):
    """A count read from a value no launcher writes would be a guess: refused, named."""
    from hps.distributed.comm import local_ranks_from_environment
    with pytest.raises(ValueError, match=message):
        local_ranks_from_environment(env)


def test_the_sketch_memory_check_names_a_bad_launcher_variable(no_launcher):
    from hps.train import AdmissionConfig
    no_launcher.setenv("SLURM_TASKS_PER_NODE", "many")
    with pytest.raises(ValueError, match=r"job.toml: admission.sketch_bytes: the ranks on this machine, each of which "
                                         r"holds a sketch, cannot be counted: SLURM_TASKS_PER_NODE = 'many': 'many' "
                                         r"is not a task count"):
        AdmissionConfig(threshold=2, sketch_bytes="300KiB").check("job.toml")
    AdmissionConfig(threshold=1, sketch_bytes="300KiB").check("job.toml")  # no sketch: nothing to count


def test_multi_hot_bags_are_rewritten_too():
    adm = Admission(threshold=2, sketch_bytes="64KiB")
    b = hps.data.Batch(np.zeros(2, np.float32), np.zeros((2, 1), np.float32), np.array([[1], [2]], np.uint64), (),
                       (hps.data.Bags(np.array([1, 3, 3], np.uint64), np.array([0, 1, 3])),))
    out = adm.train_batch(b)  # one count over the keys and the bags: key 1 and key 3 are seen twice
    assert out.keys.tolist() == [[1], [ADMISSION_DEFAULT_KEY]]
    assert out.bags[0].keys.tolist() == [1, 3, 3] and adm.default_reads == 1
    assert b.keys.tolist() == [[1], [2]]  # the source batch is left as it was
    ev = adm.eval_batch(hps.data.Batch(b.labels, b.dense, np.array([[3], [4]], np.uint64)))
    adm.end_evaluation()
    assert ev.keys.tolist() == [[3], [ADMISSION_DEFAULT_KEY]] and (adm.eval_reads, adm.eval_default_reads) == (2, 1)


def test_bench_quick_and_its_report_table():
    import importlib.util
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "bench" / "admission_bench.py"), "--quick", "--no-save"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["quick"] and line["provenance"]["command"].startswith("python3 bench/admission_bench.py")
    runs = line["synthetic"]["runs"]
    assert [r["threshold"] for r in runs] == [1, 2, 4, 8]
    assert runs[0]["default_reads"] == 0 and runs[0]["sketch_bytes"] == 0
    created = [r["rows_created"] for r in runs]
    assert created == sorted(created, reverse=True) and created[-1] < created[0]
    for r in runs[1:]:
        assert r["rows_created"] == r["keys_admitted"] + 1 and r["default_reads"] == r["dropped_gradients"] > 0
    spec = importlib.util.spec_from_file_location("hps_bench_report", root / "bench" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    assert report.workload_of(line) == "w13"
    rows = [r for r in report.render_w13(line) if r.startswith("| synthetic")]
    assert len(rows) == 4 and rows[0].startswith(f"| synthetic | 1 | {runs[0]['rows_created']:,} |")
