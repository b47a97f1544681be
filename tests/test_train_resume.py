"""`hps train` stopped at a random batch and resumed ends where the uninterrupted run
ends (docs/training.md, "Checkpoints, crashes and `--resume`"), over random settings.

Each draw trains one setting twice: run A straight through, run B stopped once or
twice and resumed (`resume=True`) to the end. A stop is one of the two ways a run
ends early in process that the docs say a resume continues from:

- a cap: `[data] train_examples` at a batch boundary, then the full count with
  `resume=True` ("`--examples 20000 --resume` after a run of 10,000 trains examples
  10,000-19,999"); the capped run ends with its final evaluation and checkpoint;
- an interrupt: the data raises KeyboardInterrupt when asked for batch k ("a stage
  that fails stops the run with its error (an interrupt, Ctrl-C, too)"), so the
  run ends wherever its pipeline was, and its resume starts from the last
  checkpoint (from batch 0 when there was none).

The module's tests in test_train_crash.py kill `hps train` processes in one
setting; this one varies what the config lets vary together: pipelined or not,
one or two devices, the sequential or Herald schedule, a lookahead window, MEM-PS's
policy and a budget small enough that rows go to SSD-PS, the checkpoint and
evaluation intervals, held-out data or none, admission, the optimizer.

B must end with A's embedding rows (every key of the data, pulled), MLP, dense
optimizer state, examples, batches, admission counts and final AUC / logloss, bit
for bit. Herald on two devices excepted: a resumed run starts with empty worker
caches, so it partitions batches otherwise and sums floats in another order
(docs/training.md, Herald's schedule); there the tolerances are
tests/test_worker_caches.py's for Herald against the sequential schedule."""
import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install torch)")
import hps  # noqa: E402
from hps.mem_cache import POLICIES  # noqa: E402
from hps.config import parse_bytes  # noqa: E402
from hps.train import TrainConfig, load_trainer_state, train  # noqa: E402

# 26 fields (the trainer's widths for batches given as an iterator are Criteo's):
# 22 of 3 keys and 4 larger, a batch's distinct keys about 200 at most, the data's
# about 800, so a MEM-PS of a few hundred rows evicts to SSD-PS.
VOCAB = [3] * 22 + [50, 100, 200, 400]
OPTIMIZERS = {"sgd": {"lr": 0.05}, "adagrad": {"lr": 0.05}, "rowwise_adagrad": {"lr": 0.05},
              "adam": {"lr": 0.01}}


ROOM = 512 << 10  # MEM-PS's lookahead room: 6 batches of 64 examples take less


def config(path, s: dict, examples: int) -> TrainConfig:
    return TrainConfig.from_dict({
        "hidden": [8], "dense_lr": 0.01, "torch_threads": 1,  # sums in one order: compared bit for bit
        "pipelined": s["pipelined"], "checkpoint_every": s["checkpoint_every"], "eval_every": s["eval_every"],
        "keep_freed_memory": False,
        # MEM-PS's rows as s["mem_budget"] holds them, and ROOM more for the lookahead window.
        "ps": {"dim": 4, "path": str(path), "mem_budget": parse_bytes(s["mem_budget"], "mem_budget") + ROOM,
               "lookahead_room": ROOM, "cache_policy": s["cache_policy"],
               "devices": s["devices"], "schedule": s["schedule"], "worker_cache_rows": s["worker_cache_rows"],
               "lookahead": s["lookahead"], "write_buffer_rows": 32,
               "optimizer": {"kind": s["optimizer"], **OPTIMIZERS[s["optimizer"]]},
               "ssd": {"file_records": 128}},
        "data": {"batch_size": s["batch"], "train_examples": examples, "eval_examples": s["eval_examples"],
                 "vocab_sizes": VOCAB},
        "admission": {"threshold": s["threshold"], "sketch_bytes": "16KiB"}})


def data(s: dict):
    """The batches config() reads: synthetic data's train stream."""
    return hps.data.SyntheticCriteo(seed=0, batch_size=s["batch"], examples=s["examples"], part="train",
                                    vocab_sizes=VOCAB)


def interrupted_at(batches, k: int):
    """`batches`, raising KeyboardInterrupt when asked for batch k (its reader's
    stage fails there, as Ctrl-C stops a run)."""
    for i, b in enumerate(batches):
        if i == k:
            raise KeyboardInterrupt(f"batch {k}")
        yield b


def parameters(path, s: dict) -> dict:
    keys = np.unique(np.concatenate([b.keys.ravel() for b in data(s)]))
    ps = hps.ParameterServer.open(str(path))
    try:
        rows = ps.pull(keys)
    finally:
        ps.close()
    state = load_trainer_state(str(path))
    return {"rows": rows, "mlp": state["mlp"], "opt": state["opt"]}


def settings():
    @st.composite
    def draw(draw):
        s = {"pipelined": draw(st.booleans()), "devices": draw(st.integers(1, 2)),
             "schedule": draw(st.sampled_from(["sequential", "herald"])),
             "worker_cache_rows": draw(st.sampled_from([16, 64, 1024])),
             "lookahead": draw(st.integers(0, 6)), "cache_policy": draw(st.sampled_from(POLICIES)),
             "checkpoint_every": draw(st.integers(0, 4)), "eval_every": draw(st.integers(0, 3)),
             "eval_examples": draw(st.sampled_from([0, 64])), "threshold": draw(st.integers(1, 2)),
             "optimizer": draw(st.sampled_from(sorted(OPTIMIZERS))), "batch": draw(st.sampled_from([32, 64]))}
        # MEM-PS must hold one batch (at most 166 and 211 rows here; an Adam row with
        # its cache's overhead takes about 165 bytes), and evicts the rest.
        s["mem_budget"] = draw(st.sampled_from(["32KiB", "40KiB"] if s["batch"] == 32 else ["40KiB", "48KiB"]))
        batches = draw(st.integers(4, 9))
        short = draw(st.sampled_from([0, 0, 7]))  # examples of a last, short batch
        s["examples"] = s["batch"] * batches + short
        at = draw(st.lists(st.integers(1, batches - 1), min_size=1, max_size=2, unique=True).map(sorted))
        s["stops"] = [(draw(st.sampled_from(["cap", "interrupt"])), k) for k in at]
        return s
    return draw()


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(settings())
def test_a_run_stopped_at_random_batches_and_resumed_ends_as_the_uninterrupted_run(tmp_path_factory, s):
    tmp = tmp_path_factory.mktemp("resume")
    want = train(config(tmp / "a", s, s["examples"]), progress=False)
    for how, k in s["stops"]:
        if how == "cap":
            capped = train(config(tmp / "b", s, s["batch"] * k), resume=True, progress=False)
            assert capped["batches"] >= k  # (the run before it may have gone past k: a later stop)
        else:
            with pytest.raises(KeyboardInterrupt):
                train(config(tmp / "b", s, s["examples"]), resume=True, progress=False,
                      train_batches=interrupted_at(data(s), k))
    got = train(config(tmp / "b", s, s["examples"]), resume=True, progress=False)

    assert (got["examples"], got["batches"]) == (want["examples"], want["batches"]) == \
        (s["examples"], -(-s["examples"] // s["batch"]))
    for name in ("occurrences_counted", "keys_admitted", "default_reads", "dropped_gradients"):
        assert got["admission"].get(name) == want["admission"].get(name), name
    a, b = parameters(tmp / "a", s), parameters(tmp / "b", s)
    if s["schedule"] == "herald" and s["devices"] > 1:
        np.testing.assert_allclose(b["rows"], a["rows"], rtol=1e-5, atol=1e-6)
        for name, value in a["mlp"].items():
            np.testing.assert_allclose(b["mlp"][name].numpy(), value.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
        return
    np.testing.assert_array_equal(b["rows"], a["rows"])
    for name, value in a["mlp"].items():
        assert torch.equal(b["mlp"][name], value), name
    for index, state in a["opt"]["state"].items():
        for name, value in state.items():
            assert torch.equal(b["opt"]["state"][index][name], value), (index, name)
    for name in ("auc", "logloss"):
        assert got["final"].get(name) == want["final"].get(name), name


# One setting of 6 batches, checkpoints every 2, for the tests of one case.
SMALL = {"pipelined": True, "checkpoint_every": 2, "eval_every": 0, "mem_budget": "40KiB",
         "cache_policy": "tinylfu-lfu", "devices": 1, "schedule": "sequential", "worker_cache_rows": 64,
         "lookahead": 0, "optimizer": "adagrad", "batch": 32, "eval_examples": 0, "threshold": 1,
         "examples": 32 * 6}


def test_a_run_that_fails_lets_go_of_its_path_while_its_error_is_held(tmp_path):
    """A failed train() (an interrupt here) closes its server before it raises: its
    error's traceback, which an interactive session keeps (sys.last_traceback) and
    pytest.raises keeps here, holds the trainer, whose open server held the path's
    lock, so a resume in the same process was refused ("another parameter server
    has this path open (pid <this one>)") until the garbage collector ran."""
    s = dict(SMALL)
    with pytest.raises(KeyboardInterrupt, match="batch 3") as stopped:
        train(config(tmp_path / "ps", s, s["examples"]), progress=False, train_batches=interrupted_at(data(s), 3))
    got = train(config(tmp_path / "ps", s, s["examples"]), resume=True, progress=False)
    assert (got["batches"], got["started_at"]["batches"]) == (6, 2)
    assert stopped.value.__traceback__ is not None


def test_a_run_that_fails_to_set_up_lets_go_of_its_path_while_its_error_is_held(tmp_path):
    """A run that fails once its server is open, before it trains, closes the server
    too: a resume with another `hidden` (whose MLP cannot take the checkpoint's, found
    as the Trainer loads it) and a dense hook that raises. Their errors' tracebacks
    hold the trainer, whose open server held the path's lock, so the corrected run in
    the same process was refused ("another parameter server has this path open (pid
    <this one>)") until the garbage collector ran."""
    s = dict(SMALL)
    path = tmp_path / "ps"
    train(config(path, s, s["batch"] * 2), progress=False)
    wider = config(path, s, s["examples"])
    wider.hidden = (16,)
    with pytest.raises(RuntimeError, match="size mismatch") as refused:
        train(wider, resume=True, progress=False)

    def hook(trainer):
        raise ValueError("the hook failed")
    with pytest.raises(ValueError, match="the hook failed") as hooked:
        train(config(path, s, s["examples"]), resume=True, progress=False, dense_hook=hook)
    got = train(config(path, s, s["examples"]), resume=True, progress=False)
    assert (got["batches"], got["started_at"]["batches"]) == (6, 2)
    assert refused.value.__traceback__ is not None and hooked.value.__traceback__ is not None
