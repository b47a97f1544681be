"""Hogwild nets (hps.hierarchical.hogwild, [hierarchical] nets = R): R threads of a
trainer on one shared copy of its dense parameters. In one process through
hps.train.train's dense_hook (as hps.hierarchical.roles installs them), and under
mpiexec with a group PS, two trainers and two groups."""
from __future__ import annotations

import json
import os
import re
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from hps.hierarchical.hogwild import HogwildNets, HogwildOptimizers, install  # noqa: E402
from hps.hierarchical.roles import HierarchicalConfig, _flatten  # noqa: E402
from hps.train import load_trainer_state, train  # noqa: E402
from hps.tuning import dense_adam  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


import ht_scenarios as sc  # noqa: E402 - tests/ is on pytest's sys.path
import mpi_scenarios as ms  # noqa: E402

needs_mpi = pytest.mark.skipif(not ms.MPI_READY, reason=ms.MPI_MISSING)

AUC_TOLERANCE = 0.02  # R = 2 against R = 1 on the synthetic run below (measured: 0.008 apart)


def _train(path, batches, nets: int, eval_batches=(), on_nets=None) -> dict:
    """hps.train.train of ms.train_config (2 devices: two mini-batches a batch); with
    nets >= 1 the dense model trains as `nets` Hogwild nets, as roles installs them;
    nets = 0: Trainer.step, untouched."""
    made: dict = {}

    def hook(trainer) -> None:
        live = _flatten(list(trainer.model.mlp.parameters()))
        made["nets"] = install(trainer, nets, lambda ps: dense_adam(ps, trainer.cfg.dense_lr), live)
        if on_nets is not None:
            on_nets(made["nets"])

    summary = train(ms.train_config(str(path)), progress=False, train_batches=batches,
                    eval_batches=list(eval_batches), dense_hook=hook if nets else None)
    if nets:
        made["nets"].close()
        summary["net_examples"] = made["nets"].examples
    summary["mlp"] = {k: v.numpy() for k, v in load_trainer_state(str(path))["mlp"].items()}
    return summary


def test_one_net_computes_exactly_what_the_synchronous_step_does(tmp_path):
    # The Hogwild step with R = 1 (the MLP's input tapped, a thread's forward and
    # backward a mini-batch, the embedding gradients pushed after) against
    # Trainer.step: the same bits, so R > 1 differs only by its R nets.
    batches = ms.global_batches(5, 48, 1)
    ref = _train(tmp_path / "step", batches, 0)
    one = _train(tmp_path / "one", batches, 1)
    assert one["net_examples"] == [5 * 48] and one["examples"] == ref["examples"] == 5 * 48
    assert set(one["mlp"]) == set(ref["mlp"])
    for name, value in ref["mlp"].items():
        assert one["mlp"][name].tobytes() == value.tobytes(), name
    two = _train(tmp_path / "two", batches, 2)
    assert any(not np.array_equal(two["mlp"][k], v) for k, v in ref["mlp"].items())  # two nets: other steps


@pytest.mark.parametrize("nets", [2, 3])
def test_nets_train_every_example_exactly_once_an_epoch(tmp_path, nets):
    # 4 batches of 50 over 2 devices (mini-batches of 25): 2 nets cut at the
    # mini-batches' boundary, 3 nets across it.
    batches = ms.global_batches(4, 50, 1)
    seen: list = [[] for _ in range(nets)]

    def watch(hog):
        for r, net in enumerate(hog.nets):  # the dense features are the MLP input's last 13 columns
            net.register_forward_pre_hook(lambda m, args, r=r: seen[r].append(args[0][:, -13:].detach().numpy().copy()))

    out = _train(tmp_path / "run", batches, nets, on_nets=watch)
    assert out["examples"] == sum(out["net_examples"]) == 200
    assert out["net_examples"] == [4 * (50 * (r + 1) // nets - 50 * r // nets) for r in range(nets)]
    rows = [np.concatenate(s) for s in seen]
    assert [len(r) for r in rows] == out["net_examples"]
    want = sorted(r.tobytes() for b in batches for r in b.dense)
    assert sorted(r.tobytes() for part in rows for r in part) == want  # each example once, none twice


def test_nets_share_one_copy_and_a_step_of_one_is_seen_by_the_other():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    live = _flatten(list(seq.parameters()))
    hog = HogwildNets(seq, live, 2, lambda ps: torch.optim.SGD(ps, lr=0.5))
    a, b = hog.params
    for pa, pb, p in zip(a, b, seq.parameters()):
        assert pa is not pb and pa.data_ptr() == pb.data_ptr() == p.data_ptr()  # own tensors, one memory
    x = torch.randn(5, 4)
    pending = hog.nets[1](x).sum()  # net 1's graph keeps the weights it read
    before = b[0].detach().clone()

    def net0_steps():
        hog.nets[0](x).sum().backward()
        hog.optimizers[0].step()

    t = threading.Thread(target=net0_steps)
    t.start()
    t.join()
    assert not torch.equal(b[0].detach(), before)  # net 1 sees net 0's step
    assert torch.equal(b[0].detach(), a[0].detach()) and torch.equal(seq[0].weight.detach(), a[0].detach())
    # Net 0's in-place step does not fail net 1's backward (each has its own version counter) ...
    pending.backward()
    # ... and each net has its own gradient.
    assert a[0].grad is not None and b[0].grad is not None and a[0].grad.data_ptr() != b[0].grad.data_ptr()
    hog.close()


def test_two_nets_reach_the_auc_of_one(tmp_path):
    vocab = [50, 200, 1000, 30] * 6 + [100, 7]
    from hps.data import SyntheticCriteo
    batches = list(SyntheticCriteo(seed=5, batch_size=128, examples=128 * 40, vocab_sizes=vocab))
    held_out = list(SyntheticCriteo(seed=99, batch_size=512, examples=2048, vocab_sizes=vocab))
    one = _train(tmp_path / "one", batches, 0, held_out)["final"]
    two = _train(tmp_path / "two", batches, 2, held_out)["final"]
    # One batch of training scores 0.49 here: both learned, and two nets as well as one.
    assert one["auc"] > 0.56 and two["auc"] > 0.56, (one, two)
    assert abs(two["auc"] - one["auc"]) <= AUC_TOLERANCE, (one["auc"], two["auc"])


def test_nets_config_errors_name_the_field():
    assert HierarchicalConfig.from_dict({"nets": 4}).nets == 4
    for bad in (0, -1, "2", True, 1.5):
        with pytest.raises(ValueError, match=rf"\[hierarchical\]: nets must be an int >= 1, got {re.escape(repr(bad))}"):
            HierarchicalConfig.from_dict({"nets": bad})
    seq = nn.Sequential(nn.Linear(2, 1))
    with pytest.raises(ValueError, match="nets must be an int >= 1, got 0"):
        HogwildNets(seq, _flatten(list(seq.parameters())), 0, lambda ps: None)
    with pytest.raises(ValueError, match="parameters must lie in `live`"):
        HogwildNets(nn.Sequential(nn.Linear(2, 1)), np.zeros(3, np.float32), 2, lambda ps: None)
    opts = HogwildOptimizers([torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1) for _ in range(2)])
    with pytest.raises(ValueError, match=r"holds 3 Hogwild net\(s\), this run has 2 \(\[hierarchical\] nets\)"):
        opts.load_state_dict({"nets": [{}, {}, {}]})


def _run(tmp_path, n, *args):
    ms.mpirun(n, sys.executable, os.path.join(HERE, "ht_scenarios.py"), "ht_train", tmp_path, *args, timeout=180)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]


@needs_mpi
def test_two_trainers_of_two_nets_with_a_group_ps_stay_one_replica(tmp_path):
    # A group of 2 trainers (2 nets each) and a group PS holding the first Linear:
    # net r all-reduces with net r of the other trainer, the PS serves all four nets
    # and steps once a batch, and trainer 0's copy is broadcast after each batch.
    out = _run(tmp_path, 3, 1, 1, "ps:vertical,trainer", "nets=2")
    assert out[0]["hierarchical"]["roles"] == ("group 0: trainer rank(s) [0, 1], group PS rank(s) [2]; "
                                               "2 Hogwild nets a trainer (threads on one dense copy)")
    assert out[2]["role"] == "group_ps" and out[2]["steps"] == sc.HT_STEPS
    for r in (0, 1):
        h = out[r]["hierarchical"]
        assert out[r]["batches"] == sc.HT_STEPS and h["nets"] == 2
        assert h["net_examples"] == [sc.HT_STEPS * sc.HT_PER_RANK // 2] * 2
        assert h["bytes"]["activations"]["before"] > 0  # the nets' forward passes reached the PS
    a, b = np.load(tmp_path / "mlp0.npz"), np.load(tmp_path / "mlp1.npz")
    for name in a.files:
        assert a[name].tobytes() == b[name].tobytes(), name
    # Trained (the equality above is not that of two untouched copies): every layer moved from the
    # weights the config's seed gives.
    from hps.torch import mlp as make_mlp
    cfg = ms.train_config(str(tmp_path / "unused"))
    start = {k: v.detach().numpy() for k, v in make_mlp(26 * 8 + 13, cfg.hidden, seed=cfg.seed).state_dict().items()}
    assert set(start) == set(a.files)
    assert all(not np.array_equal(a[k], start[k]) for k in a.files)


@needs_mpi
def test_hps_train_runs_hogwild_nets_in_two_groups(tmp_path):
    import test_ht_train  # its hps_train launcher
    line, out = test_ht_train.hps_train(tmp_path, 3, 'hidden = [16]\ntorch_threads = 1\n[ps]\ndim = 4\npath = "{path}"\n'
                          'mem_budget = "1MiB"\n[data]\nbatch_size = 128\ntrain_examples = 1024\n'
                          'eval_examples = 128\n[hierarchical]\ngroups = 2\nnets = 2\n')
    assert "; 2 Hogwild nets a trainer (threads on one dense copy); plan " in line, line
    m = re.search(r"; (\d+) background exchange\(s\), (\d+) correction\(s\) applied", line)
    assert m and int(m.group(1)) >= 1 and int(m.group(2)) >= 1, line
    h = out["hierarchical"]
    # This trainer's examples (the synthetic source gives each trainer rank its own), every one by one net.
    assert h["nets"] == 2 and sum(h["net_examples"]) == out["pipeline"]["examples"] > 0
    assert min(h["net_examples"]) > 0


@needs_mpi
def test_a_trainer_whose_nets_stop_taking_part_ends_the_job_naming_the_all_reduce(tmp_path):
    # Two trainers of two nets, no group PS; trainer 1's nets hang before their
    # gradients' all-reduce: trainer 0's nets waited in it for ever. They now wait
    # `timeout` (2 s) and the job ends naming the all-reduce and the group's ranks.
    import test_ht_train  # its launcher of a job that must end
    err = test_ht_train._run_until_it_ends(tmp_path, 2, 1, 0, "-", "nets=2", "timeout=2", "stall_net_on=1")
    assert re.search(r"AllreduceTimeout: Hogwild net [01]'s gradients: the all-reduce over ranks \[0, 1\] did not "
                     r"complete within 2 s \(a rank died, hung or stopped taking part\); aborting the job", err), \
        err[-3000:]


@needs_mpi
def test_a_trainer_that_stops_sharing_its_nets_replica_ends_the_job_naming_the_broadcast(tmp_path):
    # Two trainers of two nets; trainer 0 hangs instead of broadcasting the nets'
    # replica after a step: trainer 1 waited in the broadcast for ever. It now waits
    # `timeout` (2 s) and the job ends naming the broadcast and the group's ranks.
    import test_ht_train
    err = test_ht_train._run_until_it_ends(tmp_path, 2, 1, 0, "-", "nets=2", "timeout=2", "stall_share_on=0")
    assert ("BroadcastTimeout: the Hogwild nets' replica: the broadcast from rank 0 over ranks [0, 1] did not "
            "complete within 2 s (a rank died, hung or stopped taking part); aborting the job") in err, err[-3000:]


@needs_mpi
def test_a_resumed_job_of_two_nets_goes_on_from_its_checkpoint(tmp_path):
    # A group of two trainers of two nets and a group PS, checkpointed every 3 of 6
    # batches; trainer rank 0 dies right after the checkpoint at batch 3 and the job
    # resumes there. Hogwild nets race on one copy by design, so the resumed job
    # cannot end with the straight run's bits; what must hold: it goes on at batch 3
    # with every net's optimizer state (each parameter's Adam steps end at 6, 3 of
    # them from the checkpoint) and the group PS's blocks, keeps the layout and plan,
    # and its trainers end one replica.
    import test_ht_train
    args = ("ps:vertical,trainer", "nets=2", "steps=6", "checkpoint_every=3")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir(), resumed.mkdir()
    ref = _run(straight, 3, 1, 1, *args)
    test_ht_train._crashed_after_3(resumed, 3, 1, 1, *args)
    got = _run(resumed, 3, 1, 1, *args, "resume=1")
    assert got[2]["role"] == "group_ps" and got[2]["resumed"] and got[2]["steps"] == ref[2]["steps"] == 6
    for r in (0, 1):
        assert got[r]["batches"] == ref[r]["batches"] == 6
        h, h_ref = got[r]["hierarchical"], ref[r]["hierarchical"]
        assert (h["roles"], h["plan"], h["nets"]) == (h_ref["roles"], h_ref["plan"], 2)
        for job in (straight, resumed):
            nets = load_trainer_state(str(job / "job" / f"rank{r}"))["opt"]["nets"]
            steps = [int(s["step"]) for net in nets for s in net["state"].values()]
            assert len(nets) == 2 and steps and set(steps) == {6}, (job, r, steps)
    a, b = np.load(resumed / "mlp0.npz"), np.load(resumed / "mlp1.npz")
    for name in a.files:
        assert a[name].tobytes() == b[name].tobytes(), name


@pytest.mark.parametrize("nets", [1, 2])
def test_a_diverged_hogwild_run_stops_before_a_nan_reaches_the_job(tmp_path, nets):
    # An example whose dense feature is NaN in batch 3: its loss is NaN. Trainer.step
    # stops the run at that batch (DivergedError) before its gradients reach a row or
    # a weight; the Hogwild step, which takes its place, went on: its net stepped the
    # NaN into the shared MLP, pushed it into the embedding rows, and the run
    # checkpointed them and ended as if it had trained.
    import dataclasses
    import hps
    path = tmp_path / "ps"
    cfg = dataclasses.replace(ms.train_config(str(path)), checkpoint_every=1)
    batches = ms.global_batches(5, 48, 1)
    batches[2].dense[5, 0] = np.nan  # worker 0's mini-batch (rows 0..23), net 0's slice

    def hook(trainer) -> None:
        live = _flatten(list(trainer.model.mlp.parameters()))
        install(trainer, nets, lambda ps: dense_adam(ps, trainer.cfg.dense_lr), live)

    with pytest.raises(hps.errors.DivergedError, match=r"^batch 3: the loss is nan \(worker 0, Hogwild net 0\): "
                                                       r"training diverged \(a learning rate too high\? dense_lr = "):
        train(cfg, progress=False, train_batches=batches, dense_hook=hook)
    state = load_trainer_state(str(path))  # the last finished checkpoint (batch 2): numbers only
    assert state["batches_done"] == 2
    assert all(torch.isfinite(v).all() for v in state["mlp"].values())
    keys = np.unique(np.concatenate([b.keys.ravel() for b in batches]))
    ps = hps.ParameterServer.open(str(path))
    try:
        assert np.isfinite(ps.pull(keys)).all()
    finally:
        ps.close()
