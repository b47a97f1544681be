"""Hierarchical Training in `hps train` (hps.hierarchical.roles) under mpiexec on
localhost: one group equals today's all-reduce training, a split MLP over two group
PSs equals one process, and two groups average with a centre in the background."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
from hps.hierarchical.roles import HierarchicalConfig, Roles, parse_placement  # noqa: E402
from hps.hierarchical.split_mlp import FcPlacement as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ht_scenarios.py")


import ht_scenarios as sc  # noqa: E402 - tests/ is on pytest's sys.path
import mpi_scenarios as ms  # noqa: E402

MPIEXEC = ms.MPIEXEC
needs_mpi = pytest.mark.skipif(not ms.MPI_READY, reason=ms.MPI_MISSING)


def _run(tmp_path, n, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    p = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, SCRIPT, "ht_train", tmp_path, *map(str, args)],
                       capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stderr[-5000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]


def _reference(tmp_path, trainers):
    """Today's training in one process over the global batches (which
    tests/test_distributed.py shows all-reduce training equals)."""
    from hps.train import load_trainer_state, train
    batches = ms.global_batches(sc.HT_STEPS, sc.HT_PER_RANK, trainers)
    train(ms.train_config(str(tmp_path / "single")), progress=False, train_batches=batches, eval_batches=[])
    return {k: v.numpy() for k, v in load_trainer_state(str(tmp_path / "single"))["mlp"].items()}


@needs_mpi
def test_one_group_of_two_trainers_equals_allreduce_training(tmp_path):
    # Two trainers and a group PS holding the first Linear: the trainers all-reduce the
    # second one's gradients, the PS sums both trainers' and steps once they both asked.
    out = _run(tmp_path, 3, 1, 1, "ps:vertical,trainer")
    ref = _reference(tmp_path, 2)
    assert out[2]["role"] == "group_ps" and out[2]["steps"] == sc.HT_STEPS
    for r in range(2):
        assert out[r]["hierarchical"]["roles"] == "group 0: trainer rank(s) [0, 1], group PS rank(s) [2]"
        assert out[r]["batches"] == sc.HT_STEPS
        got = np.load(tmp_path / f"mlp{r}.npz")
        assert set(got.files) == set(ref)
        for name, value in ref.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-6, err_msg=f"rank {r}: {name}")


@needs_mpi
def test_split_mlp_over_two_group_ps_equals_one_process(tmp_path):
    out = _run(tmp_path, 3, 1, 2, "ps:vertical,ps:horizontal")
    ref = _reference(tmp_path, 1)
    got = np.load(tmp_path / "mlp0.npz")
    for name, value in ref.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
    h = out[0]["hierarchical"]
    assert h["roles"] == "group 0: trainer rank(s) [0], group PS rank(s) [1, 2]"
    assert h["plan"] == ["ps:vertical", "ps:horizontal"]
    assert h["bytes"]["activations"]["before"] > 0 and h["bytes"]["gradients"]["before"] > 0
    assert [o["steps"] for o in out[1:]] == [sc.HT_STEPS, sc.HT_STEPS]
    # Every role measures its own time (a benchmark holds it against the planner's model).
    for o in (h, *out[1:]):
        assert o["cpu_seconds"] > 0 and o["wall_seconds"] > 0, o


@needs_mpi
def test_two_groups_average_with_the_centre_in_the_background(tmp_path):
    out = _run(tmp_path, 3, 2, 0)
    assert out[0]["hierarchical"]["roles"] == ("group 0: trainer rank(s) [0], group PS rank(s) -; group 1: trainer "
                                               "rank(s) [1], group PS rank(s) -; centre: rank 2 (background EASGD)")
    done = [o["hierarchical"]["exchanges"] for o in out[:2]]
    assert all(1 <= d <= sc.HT_STEPS for d in done)
    assert [o["hierarchical"]["corrections"] for o in out[:2]] == done  # the last one lands at the end
    assert out[2]["role"] == "centre" and out[2]["exchanges"] == sum(done)
    assert out[2]["cpu_seconds"] > 0 and out[2]["wall_seconds"] > 0
    assert out[2]["bytes"]["averaging"]["after"] > 0
    a, b = np.load(tmp_path / "mlp0.npz"), np.load(tmp_path / "mlp1.npz")
    assert any(not np.array_equal(a[n], b[n]) for n in a.files)  # two replicas, trained on different data


@needs_mpi
@pytest.mark.parametrize("group_ps", [0, 1])
def test_two_groups_of_two_trainers_keep_one_replica_a_group(tmp_path, group_ps):
    # Trainer 0 of each group (and each group PS) exchanges with the centre in the
    # background; each correction lands on both trainers of the group at one step
    # boundary, so the group's trainers end with the same bits (the all-reduced steps
    # alone would keep them equal too: the corrections are what can break it).
    placement = "ps:vertical,trainer" if group_ps else ""
    n = 2 * (2 + group_ps) + 1
    out = _run(tmp_path, n, 2, group_ps, *([placement] if placement else []))
    roles = Roles.layout(n, 0, HierarchicalConfig(groups=2, group_ps=group_ps))
    groups = [roles.trainer_ranks(g) for g in range(2)]
    assert groups == ([[0, 1], [3, 4]] if group_ps else [[0, 1], [2, 3]])
    assert out[0]["hierarchical"]["roles"] == roles.describe()
    assert f"centre: rank {n - 1} (background EASGD; trainer ranks [0, {groups[1][0]}] exchange" in roles.describe()
    mlps = {r: np.load(tmp_path / f"mlp{r}.npz") for g in groups for r in g}
    for first, peer in groups:
        h0, h1 = out[first]["hierarchical"], out[peer]["hierarchical"]
        assert out[first]["batches"] == out[peer]["batches"] == sc.HT_STEPS
        assert 1 <= h0["exchanges"] <= sc.HT_STEPS and h1["exchanges"] == 0  # trainer 0 exchanges
        assert h0["corrections"] == h1["corrections"] == h0["exchanges"]  # all landed, on both
        for name in mlps[first].files:
            assert mlps[first][name].tobytes() == mlps[peer][name].tobytes(), f"ranks {first}, {peer}: {name}"
    a, b = mlps[groups[0][0]], mlps[groups[1][0]]
    assert any(not np.array_equal(a[k], b[k]) for k in a.files)  # two replicas, trained on different data
    centre = out[n - 1]
    assert centre["role"] == "centre"
    ps = [o for o in out if o["role"] == "group_ps"]
    assert len(ps) == 2 * group_ps
    for o in ps:
        assert o["steps"] == sc.HT_STEPS and 1 <= o["exchanges"] == o["corrections"] <= sc.HT_STEPS
    assert centre["exchanges"] == sum(out[g[0]]["hierarchical"]["exchanges"] for g in groups) + \
        sum(o["exchanges"] for o in ps)


@needs_mpi
def test_allreduce_across_groups_keeps_their_replicas_equal_after_every_step(tmp_path):
    # across = "allreduce", period 1: 2 groups of a trainer and a group PS, no centre;
    # after each step trainer t and PS p of both groups hold the same bits.
    out = _run(tmp_path, 4, 2, 1, "ps:vertical,trainer", "across=allreduce")
    assert out[0]["hierarchical"]["roles"] == (
        "group 0: trainer rank(s) [0], group PS rank(s) [1]; group 1: trainer rank(s) [2], group PS rank(s) [3]; "
        "across groups: synchronous all-reduce every 1 step(s) (no centre; trainer t and group PS p of each group "
        "average with their peers of the other groups)")
    for a, b in ((0, 2), (1, 3)):  # the trainers, the group PSs
        assert len(out[a]["averages"]) == sc.HT_STEPS, out[a]
        assert out[a]["averages"] == out[b]["averages"], (a, b)
        assert len(set(out[a]["averages"])) == sc.HT_STEPS  # each step moved the replica
    for r in (0, 2):
        h = out[r]["hierarchical"]
        assert h["corrections"] == sc.HT_STEPS and h["exchanges"] == 0
        assert h["bytes"]["averaging"]["before"] > 0
    for r in (1, 3):
        assert out[r]["steps"] == out[r]["corrections"] == sc.HT_STEPS
    a, b = np.load(tmp_path / "mlp0.npz"), np.load(tmp_path / "mlp2.npz")
    for name in a.files:
        assert a[name].tobytes() == b[name].tobytes(), name


@needs_mpi
def test_allreduce_across_groups_ends_with_one_model_group_ps_layers_included(tmp_path):
    # period 8 > the 5 steps: no average during training, so the one after the last
    # step (AllreduceAverage.finish) is what makes the groups one model. The trainers
    # return their group's whole MLP after training (as the final evaluation sees it):
    # the layer on the group PS must be averaged by then too, not after the trainers
    # stopped.
    out = _run(tmp_path, 4, 2, 1, "ps:vertical,trainer", "across=allreduce", "period=8")
    for r in range(4):
        assert out[r]["averages"] and len(out[r]["averages"]) == 1, out[r]
    a, b = np.load(tmp_path / "mlp0.npz"), np.load(tmp_path / "mlp2.npz")
    assert {"0.weight", "2.weight"} <= set(a.files)
    for name in a.files:
        assert a[name].tobytes() == b[name].tobytes(), name


@needs_mpi
def test_every_trainer_uses_one_plan_whatever_its_own_planner_would_give(tmp_path):
    # The planner's refinement stops at a time limit, so on a loaded machine two trainers
    # could end at different plans; each used its own, while the group PS took trainer 0's:
    # the trainers' layers and all-reduces no longer matched (a crash or a hang). Trainer 1's
    # planner is made to give another plan here: the job uses trainer 0's everywhere.
    out = _run(tmp_path, 3, 1, 1, "-", "plan_alone_on=1")
    assert out[0]["hierarchical"]["plan"] == out[1]["hierarchical"]["plan"] != ["ps:vertical", "trainer"]
    assert out[2]["role"] == "group_ps" and out[2]["steps"] == sc.HT_STEPS
    a, b = np.load(tmp_path / "mlp0.npz"), np.load(tmp_path / "mlp1.npz")
    for name in a.files:
        assert a[name].tobytes() == b[name].tobytes(), name


def hps_train(tmp_path, ranks: int, toml: str) -> tuple[str, dict]:
    """`mpiexec -n ranks hps train` on a config (its path = tmp_path/run); returns
    the printed `hierarchical:` line and the JSON line."""
    cfg = tmp_path / "ht.toml"
    cfg.write_text(toml.replace("{path}", str(tmp_path / "run")))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    p = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, "-m", "hps.cli", "train", "--config", str(cfg),
                        "--no-progress"], capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stderr[-5000:]
    return next(x for x in p.stderr.splitlines() if "hierarchical:" in x), json.loads(p.stdout.splitlines()[-1])


@needs_mpi
def test_hps_train_runs_a_hierarchical_config(tmp_path):
    line, out = hps_train(tmp_path, 2, 'hidden = [32, 16]\ntorch_threads = 1\n[ps]\ndim = 4\npath = "{path}"\n'
                          'mem_budget = "1MiB"\n[data]\nbatch_size = 256\ntrain_examples = 1024\n'
                          'eval_examples = 256\n[hierarchical]\ngroup_ps = 1\ngradients = "bf16"\n'
                          '[hierarchical.planner]\nbig_fc_bytes = 0\n')
    # The rules tag every layer for the group PS (big_fc_bytes = 0); the refinement keeps at least one there.
    assert "group 0: trainer rank(s) [0], group PS rank(s) [1]; plan " in line
    assert "ps:" in line.split("; plan ")[1].split(";")[0]
    m = re.search(r"gradients ([\d.]+) -> ([\d.]+) MB", line)
    assert m and float(m.group(2)) < float(m.group(1))  # bf16 on the wire
    assert out["final"]["examples"] == 1024


@needs_mpi
def test_hps_train_prints_the_plan_as_the_placement_is_written(tmp_path):
    # A layer held whole by group PS 0 ("ps:whole:0") was printed "ps:none", which names no
    # placement and not the PS, and a trainer's layer "trainer:none": the summary's plan and
    # the printed line now spell each place as [hierarchical] placement does.
    placement = ["ps:whole:0", "trainer", "trainer"]
    line, out = hps_train(tmp_path, 2, 'hidden = [32, 16]\ntorch_threads = 1\n[ps]\ndim = 4\npath = "{path}"\n'
                          'mem_budget = "1MiB"\n[data]\nbatch_size = 256\ntrain_examples = 512\n'
                          f'eval_examples = 256\n[hierarchical]\ngroup_ps = 1\nplacement = {json.dumps(placement)}\n')
    assert "; plan ps:whole:0, trainer, trainer;" in line, line
    assert out["hierarchical"]["plan"] == placement
    assert [parse_placement(s) for s in out["hierarchical"]["plan"]] == [F("ps", "none", ps=0), F(), F()]


@needs_mpi
def test_hps_train_prints_the_background_averages_of_several_groups(tmp_path):
    line, _ = hps_train(tmp_path, 3, 'hidden = [16]\ntorch_threads = 1\n[ps]\ndim = 4\npath = "{path}"\n'
                        'mem_budget = "1MiB"\n[data]\nbatch_size = 128\ntrain_examples = 1024\n'
                        'eval_examples = 128\n[hierarchical]\ngroups = 2\n')
    m = re.search(r"; (\d+) background exchange\(s\), (\d+) correction\(s\) applied", line)
    assert m and int(m.group(1)) >= 1 and int(m.group(2)) >= 1, line


def test_roles_layout():
    cfg = HierarchicalConfig(groups=2, group_ps=1)
    roles = [Roles.layout(5, r, cfg) for r in range(5)]
    assert [(x.role, x.group, x.index) for x in roles] == [("trainer", 0, 0), ("group_ps", 0, 0), ("trainer", 1, 0),
                                                           ("group_ps", 1, 0), ("centre", -1, -1)]
    assert roles[0].trainer_ranks() == [0, 2] and roles[0].ps_ranks(1) == [3]
    one = Roles.layout(6, 4, HierarchicalConfig(groups=1, group_ps=2))
    assert (one.trainers, one.role, one.index) == (4, "group_ps", 0)
    formula = r"world = groups \* \(trainers \+ group_ps\) \+ 1"
    with pytest.raises(ValueError, match="4 ranks cannot make 2 group.s. of 1 group PS.s. and at least one trainer "
                                         "plus a centre: " + formula):
        Roles.layout(4, 0, cfg)
    with pytest.raises(ValueError, match="6 ranks cannot make 2 group.s. of 1 group PS.s. .*: " + formula):
        Roles.layout(6, 0, cfg)  # 5 ranks left for 2 groups
    with pytest.raises(ValueError, match=r"3 ranks cannot make 1 group.s. of 3 group PS.s. and at least one trainer: "
                                         r"world = groups \* \(trainers \+ group_ps\)$"):
        Roles.layout(3, 0, HierarchicalConfig(groups=1, group_ps=3))
    # G > 1 groups of T > 1 trainers: 2 groups of 2 trainers and a group PS, and the centre.
    seven = [Roles.layout(7, r, cfg) for r in range(7)]
    assert [(x.role, x.group, x.index) for x in seven] == [
        ("trainer", 0, 0), ("trainer", 0, 1), ("group_ps", 0, 0), ("trainer", 1, 0), ("trainer", 1, 1),
        ("group_ps", 1, 0), ("centre", -1, -1)]
    assert seven[0].trainer_ranks() == [0, 1, 3, 4] and seven[0].ps_ranks(1) == [5]
    assert seven[0].describe() == ("group 0: trainer rank(s) [0, 1], group PS rank(s) [2]; group 1: trainer rank(s) "
                                   "[3, 4], group PS rank(s) [5]; centre: rank 6 (background EASGD; trainer ranks "
                                   "[0, 3] exchange for their groups, each group's trainers apply a correction at "
                                   "one step boundary)")


def test_config_errors_are_named():
    assert parse_placement("ps:vertical:pair") == F("ps", "vertical", pair=True)
    assert parse_placement("ps:whole:1") == F("ps", "none", ps=1)
    with pytest.raises(ValueError, match=r"placement\[0\]: cannot read 'ps:diagonal'"):
        HierarchicalConfig.from_dict({"placement": ["ps:diagonal"]})
    # A placement on group PSs that the run does not have: ignored silently with group_ps = 0
    # (the default: every layer stayed on the trainer), refused late (after the data and the
    # parameter server were opened) for a PS index past group_ps.
    with pytest.raises(ValueError, match=r"placement\[1\] = 'ps:vertical' puts a layer on a group PS, but "
                                         r"group_ps = 0"):
        HierarchicalConfig.from_dict({"groups": 2, "placement": ["trainer", "ps:vertical", "trainer"]})
    with pytest.raises(ValueError, match=r"placement\[0\] = 'ps:whole:2': there is no group PS 2 with group_ps = 2 "
                                         r"\(PSs 0..1\)"):
        HierarchicalConfig.from_dict({"group_ps": 2, "placement": ["ps:whole:2", "trainer"]})
    HierarchicalConfig.from_dict({"group_ps": 2, "placement": ["ps:whole:1", "trainer"]})
    HierarchicalConfig.from_dict({"placement": ["trainer", "trainer"]})  # (every layer on the trainer: fine)
    with pytest.raises(ValueError, match="averaging: unknown codec 'gzip'"):
        HierarchicalConfig.from_dict({"averaging": "gzip"})
    # A string for the list: it was read a letter a layer ("cannot read 't'").
    with pytest.raises(ValueError, match=r"placement must be a list, one place a Linear layer .*got 'trainer'"):
        HierarchicalConfig.from_dict({"placement": "trainer"})
    with pytest.raises(ValueError, match="group_ps must be an int >= 0, got True"):
        HierarchicalConfig.from_dict({"group_ps": True})
    with pytest.raises(ValueError, match="timeout must be > 0 seconds, got '60'"):  # (a TypeError before)
        HierarchicalConfig.from_dict({"timeout": "60"})
    with pytest.raises(ValueError, match="unknown field.s. hierarchical.group"):
        HierarchicalConfig.from_dict({"group": 2})
    # Not tables: a TypeError ('int' object is not iterable) that named nothing.
    with pytest.raises(ValueError, match=r"\[hierarchical\]: must be a table of fields .*got 3"):
        HierarchicalConfig.from_dict(3)
    with pytest.raises(ValueError, match=r"\[hierarchical\]: planner must be a table .*got 3"):
        HierarchicalConfig.from_dict({"planner": 3})
    with pytest.raises(ValueError, match="unknown field.s. planner.flops"):
        HierarchicalConfig.from_dict({"planner": {"flops": 1}})
    with pytest.raises(ValueError, match=r"\[hierarchical\]: across must be one of 'easgd', 'allreduce', got 'gossip'"):
        HierarchicalConfig.from_dict({"across": "gossip"})
    # Top-k of the replica sends zeros for the values it leaves out: the centre read d = -c there.
    with pytest.raises(ValueError, match=r"\[hierarchical\]: averaging = 'topk:0.1': top-k cannot compress an EASGD "
                                         r"exchange"):
        HierarchicalConfig.from_dict({"averaging": "topk:0.1"})
    with pytest.raises(ValueError, match="across = 'allreduce' sums the replicas in MPI as float32; averaging = 'bf16'"):
        HierarchicalConfig.from_dict({"across": "allreduce", "averaging": "bf16"})
    # No centre rank with across = "allreduce": 2 groups of a trainer and a PS fill 4 ranks.
    assert [Roles.layout(4, r, HierarchicalConfig(groups=2, group_ps=1, across="allreduce")).role
            for r in range(4)] == ["trainer", "group_ps", "trainer", "group_ps"]


def test_planner_fields_are_checked_with_the_config():
    # [hierarchical.planner]'s values passed the config and were checked only when a
    # trainer planned (after the data and the parameter server were opened, on trainer 0
    # only), naming the field under [hierarchical]; a string time_limit was a bare
    # TypeError ('>=' not supported), a bool optimizer_slots counted as 1.
    for planner, message in [({"bandwidth": 0}, "bandwidth must be > 0, got 0"),
                             ({"time_limit": "1"}, "time_limit must be >= 0 seconds, got '1'"),
                             ({"batch_size": "4096"}, "batch_size must be an int >= 1, got '4096'"),
                             ({"optimizer_slots": True}, "optimizer_slots must be an int >= 0, got True"),
                             ({"ps_flops": False}, "ps_flops must be > 0, got False"),
                             ({"input_width": 0}, "input_width must be an int >= 1, got 0")]:
        with pytest.raises(ValueError, match=re.escape(f"[hierarchical.planner]: {message}")):
            HierarchicalConfig.from_dict({"group_ps": 1, "planner": planner})
        with pytest.raises(ValueError, match=re.escape(f"run.toml: [hierarchical.planner]: {message}")):
            HierarchicalConfig.from_dict({"group_ps": 1, "planner": planner}, "run.toml: [hierarchical]")
    HierarchicalConfig.from_dict({"group_ps": 1, "planner": {"bandwidth": 1e9, "time_limit": 0, "input_width": 8}})


@needs_mpi
def test_a_rank_that_fails_ends_the_job_naming_why(tmp_path):
    # A placement of the wrong length is found by the trainer's dense hook, once the MLP
    # is made (the config alone cannot know its layers). The trainer printed the error
    # and returned, then waited in MPI_Finalize for its group PS, which waited for the
    # MLP the trainer never sent: the job hung until killed. A failing rank now ends
    # every rank of the job (MPI_Abort), saying which rank and why.
    cfg = tmp_path / "ht.toml"
    cfg.write_text(f'hidden = [16]\ntorch_threads = 1\n[ps]\ndim = 4\npath = "{tmp_path / "run"}"\n'
                   'mem_budget = "1MiB"\n[data]\nbatch_size = 128\ntrain_examples = 512\neval_examples = 128\n'
                   '[hierarchical]\ngroup_ps = 1\nplacement = ["ps:vertical"]\n')
    rc, err = _mpiexec_until_it_ends(2, ["-m", "hps.cli", "train", "--config", str(cfg), "--no-progress"], 60)
    assert rc != 0
    assert ("hps.hierarchical: rank 0 (trainer 0 of group 0): ValueError: [hierarchical] placement names 1 Linear "
            "layers, the MLP has 2; aborting the job") in err, err[-3000:]


def _mpiexec_until_it_ends(n: int, python_args: list, limit: float) -> tuple[int, str]:
    """`mpiexec -n n python *python_args`: its exit code and stderr. A job still
    running after `limit` seconds is ended and the test fails: it hung."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    p = subprocess.Popen([MPIEXEC, "-n", str(n), sys.executable, *python_args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, err = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        p.terminate()  # (mpiexec ends its ranks on SIGTERM)
        pytest.fail(f"the job hung: {p.communicate()[1][-3000:]}")
    return p.returncode, err


def _run_until_it_ends(tmp_path, n, *args, limit: float = 90) -> str:
    """The ht_train scenario on n ranks, which must fail; returns its stderr."""
    rc, err = _mpiexec_until_it_ends(n, [SCRIPT, "ht_train", str(tmp_path), *map(str, args)], limit)
    assert rc != 0, err[-3000:]
    return err


@needs_mpi
def test_allreduce_across_groups_ends_the_job_when_a_group_stops_taking_part(tmp_path):
    # The trainer of group 1 (rank 2) hangs instead of joining its first average: the
    # blocking all-reduce left trainer 0 of group 0 waiting for ever. It now waits
    # `timeout` (2 s here) and ends the job naming the average and the ranks.
    err = _run_until_it_ends(tmp_path, 4, 2, 1, "ps:vertical,trainer", "across=allreduce", "timeout=2",
                             "stall_average_on=2")
    assert ("AllreduceTimeout: trainer 0's average of its layers across groups: the all-reduce over ranks [0, 2] "
            "did not complete within 2 s (a rank died, hung or stopped taking part); aborting the job") in err, \
        err[-3000:]


@needs_mpi
@pytest.mark.parametrize("ranks, args", [
    (4, (2, 1, "ps:vertical,trainer", "across=allreduce")),  # a group PS a group, averaged by all-reduce
    (5, (2, 0, "-", "nets=2")),                               # 2 trainers of 2 Hogwild nets a group, the centre
    (1, (1, 0, "-", "fail_job=1")),                           # the second job fails (one rank: it raises)
], ids=["allreduce", "easgd_hogwild", "failed_job"])
def test_jobs_one_after_another_in_a_process_free_their_communicators(tmp_path, ranks, args):
    # Three jobs in the same processes, with 24 communicator ids left free (MPICH holds
    # 2048 a process). A job made about 10 a rank (the roles' Splits and Dups, its
    # Node's) and freed none: the third job failed with 'Too many communicators'.
    # Each now frees its own, when it ends and when it fails.
    p = ms.mpirun(ranks, sys.executable, SCRIPT, "ht_jobs", tmp_path, 3, *args, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-5000:]
    comms = [json.loads((tmp_path / f"comms{r}.json").read_text()) for r in range(ranks)]
    if not comms[0]["limit"]:  # the MPI's, not the test's: no cap below MOST_COMMS, or ranks whose caps differ
        counts, library = comms[0]["counts"], comms[0]["library"]
        if min(counts) >= sc.MOST_COMMS:
            pytest.skip(f"{library}: no cap to fill, each rank took {sc.MOST_COMMS} communicators (Dups of "
                        f"COMM_SELF) and none was refused; MPICH's is 2048")
        pytest.skip(f"{library}: the ranks took different numbers of communicators before one was refused "
                    f"({counts}), so the ids left free differ from rank to rank")
    for r, c in enumerate(comms):
        assert c["before"] == c["after"] == sc.SPARE_COMMS, (r, c)
    failed = 1 if "fail_job=1" in args else None
    if failed is not None:
        assert comms[0]["error"] == "job 1 fails"
    for j in range(3):
        if j == failed:
            continue
        trainer = json.loads((tmp_path / f"job{j}" / "rank0.json").read_text())
        assert trainer["role"] == "trainer" and trainer["batches"] == sc.HT_STEPS, (j, trainer)


# ---------------------------------------------------------------- --resume of a hierarchical job

RESUMED = ("ps:vertical,trainer", "across=allreduce", "period=2", "steps=6", "checkpoint_every=3", "evaluate=1")


def _crashed_after_3(tmp_path, n, *args):
    """The job at tmp_path/job, its trainer rank 0 killed right after the checkpoint at batch 3 of 6."""
    _run_until_it_ends(tmp_path, n, *args, "crash_after=3")
    job = json.loads((tmp_path / "job" / "job.json").read_text())
    assert job["step"] == 3, job


@pytest.fixture(scope="module")
def crashed_resumed_job(tmp_path_factory):
    """The RESUMED job on 4 ranks (two groups of a trainer and a group PS) crashed
    after its checkpoint at batch 3, made once for the module (a 4-rank job): each
    test that resumes it, or is refused, works on a copy of its directory. (Its
    tests are needs_mpi: they skip before it is made.)"""
    crashed = tmp_path_factory.mktemp("crashed_resumed_job")
    _crashed_after_3(crashed, 4, 2, 1, *RESUMED)
    return crashed / "job"


@needs_mpi
def test_a_resumed_allreduce_job_ends_as_the_job_run_straight(tmp_path, crashed_resumed_job):
    # Two groups of a trainer and a group PS, averaged every 2 steps. Crashed after its
    # checkpoint at batch 3, the job resumes there: the group PSs' blocks and their Adam
    # state, the steps and the averages' phase (the next at batch 4, not 5) come back,
    # so it ends with the straight run's bits and AUC.
    import shutil
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    ref = _run(straight, 4, 2, 1, *RESUMED)
    shutil.copytree(crashed_resumed_job, resumed / "job")
    got = _run(resumed, 4, 2, 1, *RESUMED, "resume=1")
    for r in (1, 3):  # the group PSs
        assert got[r]["resumed"] and got[r]["steps"] == ref[r]["steps"] == 6
        assert got[r]["averages"] == ref[r]["averages"][1:]  # those after batch 3 (4 and 6), the same bits
    for r in (0, 2):  # the trainers: every layer of the MLP, the group PS's put back
        assert got[r]["batches"] == 6 and got[r]["averages"] == ref[r]["averages"][1:]
        a, b = np.load(straight / f"mlp{r}.npz"), np.load(resumed / f"mlp{r}.npz")
        assert set(a.files) == set(b.files) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        for name in a.files:
            assert a[name].tobytes() == b[name].tobytes(), f"rank {r}: {name}"
        assert got[r]["final"] == ref[r]["final"] and got[r]["final"]["auc"] is not None


@needs_mpi
def test_a_resumed_easgd_job_starts_from_the_checkpointed_centre(tmp_path):
    # Background EASGD is not deterministic: the resumed job must run, each group PS
    # with its blocks, and the centre start from the parameters the checkpoint holds.
    import torch
    from hps.jobdir import HT_CENTRE, read_job
    args = ("ps:vertical,trainer", "steps=6", "checkpoint_every=3")
    _crashed_after_3(tmp_path, 5, 2, 1, *args)
    parts = torch.load(os.path.join(read_job(str(tmp_path / "job")).checkpoint_dir(0), HT_CENTRE),
                       weights_only=False)
    assert len(parts) == 2  # the trainers' layers, group PS 0's blocks
    out = _run(tmp_path, 5, 2, 1, *args, "resume=1")
    import zlib
    assert out[4]["role"] == "centre"
    assert out[4]["starts"] == [{"crc32": zlib.crc32(p["centre"].tobytes()), "exchanges": p["exchanges"]}
                                for p in parts]
    assert all(p["exchanges"] >= 1 for p in parts)  # (a centre that had moved)
    assert [o["resumed"] for o in out if o["role"] == "group_ps"] == [True, True]
    assert [o["batches"] for o in out if o["role"] == "trainer"] == [6, 6]


@needs_mpi
def test_a_hierarchical_resume_is_refused_on_another_layout_or_a_missing_block(tmp_path, crashed_resumed_job):
    import shutil

    def resume(name, n, *args):
        case = tmp_path / name
        shutil.copytree(crashed_resumed_job, case / "job")
        return _run_until_it_ends(case, n, *args, "steps=6", "checkpoint_every=3", "resume=1")

    # Another placement of the MLP over the group PSs.
    err = resume("placement", 4, 2, 1, "ps:horizontal,trainer", "across=allreduce", "period=2")
    assert re.search(r"--resume: the checkpoint's split of the MLP \(\S+/rank0/checkpoints/\d+/hierarchical.json, "
                     r"rank 0\) is \['ps:vertical', 'trainer'\], this run's placement gives "
                     r"\['ps:horizontal', 'trainer'\]", err), err[-3000:]
    # The same trainer ranks, grouped otherwise (one group of 2 trainers and 2 group PSs).
    err = resume("groups", 4, 1, 2, "ps:vertical,trainer")
    assert re.search(r"the checkpoint's \[hierarchical\] layout \(\S+hierarchical.json, rank 0\) is not this run's: "
                     r"groups = 2 there, 1 here; trainers = 1 there, 2 here; group_ps = 1 there, 2 here; "
                     r"across = 'allreduce' there, None here; resume with the job's layout", err), err[-3000:]
    # Another number of trainer ranks (one group of 3 and a group PS): not resharded.
    err = resume("world", 4, 1, 1, "ps:vertical,trainer")
    assert ("ran 2 trainer rank(s)" in err and "has 3 (1 group(s) of 3): a hierarchical job cannot be resharded onto "
            "another number of ranks") in err, err[-3000:]
    # One process without [hierarchical] (which would reshard the trainers' embeddings and lose the rest).
    from hps.train import train
    case = tmp_path / "one"
    shutil.copytree(crashed_resumed_job, case / "job")
    before = (case / "job" / "job.json").read_text()
    with pytest.raises(ValueError, match=r"is a hierarchical job \(\S+/rank0/checkpoints/\d+/hierarchical.json\): it "
                                         r"cannot be resharded onto another number of ranks; nothing was resharded"):
        train(ms.train_config(str(case / "job")), resume=True, progress=False,
              train_batches=ms.global_batches(6, sc.HT_PER_RANK, 1), eval_batches=[])
    assert (case / "job" / "job.json").read_text() == before
    # Group 1's first trainer (rank 2, trainer rank 1 of the job) lacks its group PS's blocks.
    case = tmp_path / "missing"
    shutil.copytree(crashed_resumed_job, case / "job")
    from hps.jobdir import read_job
    blocks = os.path.join(read_job(str(case / "job")).checkpoint_dir(1), "group-ps0.pt")
    os.remove(blocks)
    err = _run_until_it_ends(case, 4, 2, 1, *RESUMED, "resume=1")
    assert (f"--resume: {blocks} is missing: the checkpoint lacks the blocks of group PS 0 of group 1 (rank 3), "
            f"which rank 2 saves") in err, err[-3000:]


@needs_mpi
@pytest.mark.parametrize("record,named", [
    ("[2, 1]", "not a job record (a JSON list, not an object)"),
    ('{"checkpoint": 1}', "no field 'world'"),
    ('{"world": "one", "checkpoint": 1}', "field 'world' must be a number of ranks >= 1, got 'one'"),
    ('{"world": 2, "checkpoint": "1"}', "field 'checkpoint' must be a checkpoint number or null, got '1'"),
])
def test_a_hierarchical_resume_on_a_damaged_job_json_names_the_file_and_field(tmp_path, record, named):
    # Every rank read job.json on its own terms: a list ended in a bare AttributeError,
    # a world missing or "one" was called a job of None or 'one' trainer ranks, and a
    # checkpoint "1" got through to the trainers. hps.jobdir.read_job_record names
    # the file and the field, and the job is left as it was. (Not JSON was named already.)
    (tmp_path / "job" / "rank0").mkdir(parents=True)
    (tmp_path / "job" / "rank0" / "marker").write_text("the rank's files")
    (tmp_path / "job" / "job.json").write_text(record)
    before = {str(p.relative_to(tmp_path / "job")): p.read_bytes() for p in sorted((tmp_path / "job").rglob("*"))
              if p.is_file()}
    err = _run_until_it_ends(tmp_path, 4, 2, 1, *RESUMED, "resume=1")
    assert f"{tmp_path / 'job' / 'job.json'}: {named}" in err, err[-3000:]
    assert {str(p.relative_to(tmp_path / "job")): p.read_bytes() for p in sorted((tmp_path / "job").rglob("*"))
            if p.is_file()} == before


@needs_mpi
@pytest.mark.parametrize("record,named", [
    ("[2, 1]", "not a job record (a JSON list, not an object)"),
    ('{"world": "one", "checkpoint": 1}', "field 'world' must be a number of ranks >= 1, got 'one'"),
])
def test_hps_train_resumes_a_hierarchical_job_on_a_damaged_job_json_exiting_2(tmp_path, record, named):
    """mpiexec hps train --resume with [hierarchical] on a damaged job.json: every
    rank read it, raised, and ended the job through abort_job (exit 1, "aborting the
    job"), where every other hps train --resume exits 2 naming the file and the
    field. The ranks now agree on the refusal (an allgather before anything else of
    the job) and raise it on every rank: exit 2, the same message, the job's files as
    they were, no abort."""
    job = tmp_path / "run"
    (job / "rank0").mkdir(parents=True)
    (job / "rank0" / "marker").write_text("the rank's files")
    (job / "job.json").write_text(record)
    before = {str(p.relative_to(job)): p.read_bytes() for p in sorted(job.rglob("*")) if p.is_file()}
    cfg = tmp_path / "ht.toml"
    cfg.write_text(f'hidden = [16]\ntorch_threads = 1\n[ps]\ndim = 4\npath = "{job}"\nmem_budget = "1MiB"\n'
                   '[data]\nbatch_size = 128\ntrain_examples = 512\neval_examples = 128\n'
                   '[hierarchical]\ngroup_ps = 1\n')
    rc, err = _mpiexec_until_it_ends(2, ["-m", "hps.cli", "train", "--config", str(cfg), "--no-progress", "--resume"],
                                     90)
    assert rc == 2, err[-3000:]
    assert f"{job / 'job.json'}: {named}" in err, err[-3000:]
    assert "aborting the job" not in err, err[-3000:]
    assert {str(p.relative_to(job)): p.read_bytes() for p in sorted(job.rglob("*")) if p.is_file()} == before


@needs_mpi
def test_a_trainer_that_stops_reducing_gradients_ends_the_job_naming_the_all_reduce(tmp_path):
    # One group of two trainers, no group PS; trainer 1 hangs instead of all-reducing
    # the trainer-held gradients: the blocking all-reduce left trainer 0 waiting for
    # ever. It now waits `timeout` (2 s) and ends the job naming it and the ranks.
    err = _run_until_it_ends(tmp_path, 2, 1, 0, "-", "timeout=2", "stall_reduce_on=1")
    assert ("AllreduceTimeout: the trainer-held layers' gradients: the all-reduce over ranks [0, 1] did not complete "
            "within 2 s (a rank died, hung or stopped taking part); aborting the job") in err, err[-3000:]


@needs_mpi
def test_a_trainer_that_stops_broadcasting_the_first_parameters_ends_the_job_naming_the_broadcast(tmp_path):
    # Trainer 0 hangs instead of broadcasting its first parameters: trainer 1 waited
    # in the broadcast for ever; it now waits `timeout` and names the broadcast.
    err = _run_until_it_ends(tmp_path, 2, 1, 0, "-", "timeout=2", "stall_broadcast_on=0")
    assert ("BroadcastTimeout: the trainer-held layers' first parameters: the broadcast from rank 0 over ranks [0, 1] "
            "did not complete within 2 s (a rank died, hung or stopped taking part); aborting the job") in err, \
        err[-3000:]


@needs_mpi
def test_a_group_root_that_stops_landing_corrections_ends_the_job_naming_the_broadcast(tmp_path):
    # Two groups of two trainers and a centre (background EASGD); group 0's trainer 0,
    # which runs the exchange, hangs instead of broadcasting whether a correction is
    # ready: trainer 1 (rank 1) waited for ever; it now waits `timeout`.
    err = _run_until_it_ends(tmp_path, 5, 2, 0, "-", "timeout=2", "stall_land_on=0")
    assert ("BroadcastTimeout: whether an average's correction is ready: the broadcast from rank 0 over ranks [0, 1] "
            "did not complete within 2 s (a rank died, hung or stopped taking part); aborting the job") in err, \
        err[-3000:]


def test_a_placement_that_cannot_be_split_so_is_refused_naming_the_field():
    # A pair's second half must be the next layer, split horizontally: known from the
    # config alone, but refused only on the trainers, once the job had started and its
    # data and parameter server were open, as "plan: Linear 0 (...) is paired" (no
    # field named, and through the job's abort rather than hps train's config errors).
    HierarchicalConfig.from_dict({"group_ps": 1, "placement": ["ps:vertical:pair", "ps:horizontal", "trainer"]})
    for placement, j, got in [(["ps:vertical:pair", "trainer"], 0, "'trainer'"),
                              (["trainer", "ps:vertical:pair"], 1, "nothing (it is the last)"),
                              (["ps:vertical:pair", "ps:vertical:pair", "ps:horizontal"], 0, "'ps:vertical:pair'")]:
        with pytest.raises(ValueError, match=re.escape(
                f"[hierarchical]: placement[{j}] = 'ps:vertical:pair' pairs its layer with the next one, which must "
                f"be 'ps:horizontal' (the pair's second half), got {got}")):
            HierarchicalConfig.from_dict({"group_ps": 1, "placement": placement})
    # What the MLP's widths decide is found with the MLP, and named with the field too.
    from torch import nn
    from hps.hierarchical.roles import _plan_for
    mlp = nn.Sequential(nn.Linear(4, 2), nn.ReLU(), nn.Linear(2, 1))
    cfg = HierarchicalConfig.from_dict({"group_ps": 3, "placement": ["ps:vertical", "trainer"]})
    with pytest.raises(ValueError, match=re.escape(
            "[hierarchical] placement ['ps:vertical', 'trainer'] does not fit the MLP: plan: fc0 (4 -> 2, module 0 of the "
            "Sequential): its output width of 2 cannot be split over 3 group PSs")):
        _plan_for(mlp, cfg)
