"""hps.hierarchical.split_mlp: an MLP split over a trainer and 2 group PSs (each
split kind, co-partitioned pairs, the CtrModel's MLP) computes what the unsplit one
does, forward and backward, and trains to the same weights; under mpiexec on
localhost (tests/ht_scenarios.py runs the ranks) and in one process."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from hps.hierarchical.codecs import CodecStreams  # noqa: E402
from hps.hierarchical.split_mlp import (FcPlacement as F, GroupPsServer, LocalTransport, SplitPlan,  # noqa: E402
                                        SplitTrainer, segments)

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ht_scenarios.py")
_spec = importlib.util.spec_from_file_location("ht_scenarios", SCRIPT)
sc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sc)
MPIEXEC = shutil.which("mpiexec")
needs_mpi = pytest.mark.skipif(MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
                               reason="needs mpi4py and mpiexec (pip install '.[mpi]')")


def mpirun(n: int, *args, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    t0 = time.monotonic()
    p = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, SCRIPT, *map(str, args)], capture_output=True,
                       text=True, timeout=timeout, env=env)
    return p, time.monotonic() - t0


def unsplit_reference(name: str):
    """Two steps of the whole Sequential in one process: (y, dx, grads) of the
    first step and the weights after both."""
    seq, _ = sc.models()[name]
    opt = sc.make_optimizer(list(seq.parameters()))
    first = None
    for step in range(2):
        xs, labels = sc.inputs(name, seq[0].in_features, step)
        x = torch.from_numpy(xs).requires_grad_(True)
        y = seq(x)
        sc.loss_of(y, labels).backward()
        if step == 0:
            first = (y.detach().numpy().copy(), x.grad.numpy().copy(),
                     {n: p.grad.numpy().copy() for n, p in seq.named_parameters()})
        opt.step()
        opt.zero_grad()
    return first + ({n: p.detach().numpy().copy() for n, p in seq.named_parameters()},)


@needs_mpi
def test_split_mlp_over_two_group_ps_ranks_equals_the_unsplit_model(tmp_path):
    p, _ = mpirun(1 + sc.GROUP_PS, "split", tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    got = np.load(tmp_path / "split.npz")
    for name in sc.models():
        y, dx, grads, weights = unsplit_reference(name)
        np.testing.assert_allclose(got[f"{name}/y"], y, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(got[f"{name}/dx"], dx, rtol=1e-5, atol=1e-7, err_msg=name)
        assert {k.split("/", 2)[2] for k in got.files if k.startswith(f"{name}/grad/")} == set(grads)
        for n in grads:
            np.testing.assert_allclose(got[f"{name}/grad/{n}"], grads[n], rtol=1e-5, atol=1e-7,
                                       err_msg=f"{name}: {n}'s gradient")
            np.testing.assert_allclose(got[f"{name}/weight/{n}"], weights[n], rtol=1e-5, atol=1e-7,
                                       err_msg=f"{name}: {n} after two steps")
            # The steps moved every weight (a PS that skipped its step would fail above).
            assert not np.array_equal(weights[n], sc.models()[name][0].state_dict()[n].numpy())


@needs_mpi
@pytest.mark.parametrize("how", ["hang", "kill"])
def test_a_dead_group_ps_fails_the_job_in_bounded_time_naming_it(tmp_path, how):
    p, took = mpirun(3, f"dead_ps_{how}", tmp_path, timeout=60)
    assert p.returncode != 0
    assert took < 30
    if how == "hang":
        assert "group PS 1 (rank 2) did not answer the forward pass of fc0 within 2 s" in p.stderr
    else:
        # MPICH's launcher ends the job as soon as a rank dies and says by which signal;
        # it names the pid of a process it cleaned up, so the job's start names the
        # roles' pids for the reader to match.
        assert re.search(r"group PS 1: rank 2, pid \d+", p.stderr), p.stderr
        assert "Killed (signal 9)" in p.stdout + p.stderr


@needs_mpi
def test_waits_sleep_between_probes_return_on_a_message_and_time_out(tmp_path):
    # hps.distributed.poll.recv, which every wait of a hierarchical job goes through:
    # the message it asked for (tag and wildcard source matched, status filled), its
    # timeout raising the caller's error, serve's idle timeout its message; and a group
    # PS that waits IDLE_SECONDS for its first request without a timeout (as in a job)
    # sleeps: MPICH's blocking receive spun a core there. The CPU bound is loose (a
    # spinning wait takes most of a core even on a loaded machine).
    import json
    p, _ = mpirun(2, "idle_wait", tmp_path, timeout=90)
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads((tmp_path / "idle_wait.json").read_text())
    assert got["first"] == ["hello", 0, 5] and got["second"] == "other"
    msg, waited = got["timeout"]
    assert msg == "group PS 0 (rank 0) did not answer the test within 0.3 s" and 0.3 <= waited < 10
    msg, waited = got["idle_timeout"]
    assert msg == "group PS 0: no request from the trainers for 0.5 s" and 0.5 <= waited < 10
    idle = got["idle"]
    assert idle["wall_seconds"] >= sc.IDLE_SECONDS - 0.5, idle
    assert idle["cpu_seconds"] < 0.3, f"an idle group PS spun: {idle}"


def _local(name, codecs=None):
    seq, plan = sc.models()[name]
    servers = [GroupPsServer(seq, plan, i, sc.make_optimizer, CodecStreams(codecs)) for i in range(plan.group_ps)]
    return seq, SplitTrainer(seq, plan, LocalTransport(servers), CodecStreams(codecs)), servers


@pytest.mark.parametrize("name", list(sc.models()))
def test_split_in_one_process_equals_the_unsplit_model(name):
    seq, tr, _ = _local(name)
    y, dx, grads, _ = unsplit_reference(name)
    xs, labels = sc.inputs(name, seq[0].in_features, 0)
    x = torch.from_numpy(xs).requires_grad_(True)
    out = tr(x)
    sc.loss_of(out, labels).backward()
    np.testing.assert_allclose(out.detach().numpy(), y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), dx, rtol=1e-5, atol=1e-7)
    state = tr.full_state()
    for n in grads:
        np.testing.assert_allclose(state[n][1], grads[n], rtol=1e-5, atol=1e-7, err_msg=n)


def test_pairs_keep_the_intermediate_on_the_ps():
    # Pair 6 -> 16 -> 4 over 2 PSs: the trainer sends x (6 wide) to both and gets 4-wide
    # partial sums back; the 16-wide intermediate never crosses.
    _, tr, servers = _local("pair_and_whole")
    x = torch.zeros(8, 6)
    tr(x).sum().backward()
    before = tr.counter.as_dict()["activations"]["before"]
    # To PS 0 and 1: 8x6 floats each (pair), then 8x4 to PS 1 (whole layer 2).
    assert before == 4 * (2 * 8 * 6 + 8 * 4)
    back = sum(s.counter.as_dict()["activations"]["before"] for s in servers)
    assert back == 4 * (2 * 8 * 4 + 8 * 12)


def test_codecs_on_the_wire_count_bytes_and_stay_close():
    seq, tr, servers = _local("two_pairs", {"activations": "int8", "gradients": "bf16"})
    xs, labels = sc.inputs("two_pairs", 6, 0)
    x = torch.from_numpy(xs).requires_grad_(True)
    out = tr(x)
    sc.loss_of(out, labels).backward()
    y, dx, _, _ = unsplit_reference("two_pairs")
    np.testing.assert_allclose(out.detach().numpy(), y, atol=0.02)
    np.testing.assert_allclose(x.grad.numpy(), dx, atol=0.01)
    assert not np.allclose(out.detach().numpy(), y, rtol=1e-6, atol=1e-7)  # the codecs did act
    t = tr.counter.as_dict()
    # int8: one byte a value plus a 4-byte scale a row; bf16: two bytes a value.
    assert t["activations"]["after"] == t["activations"]["before"] // 4 + 4 * 8 * 5
    assert t["gradients"]["after"] * 2 == t["gradients"]["before"] > 0
    ps = [s.counter.as_dict() for s in servers]
    assert all(c["gradients"]["after"] * 2 == c["gradients"]["before"] > 0 for c in ps)


def test_bad_plans_are_refused_naming_the_layer():
    seq, _ = sc.models()["vertical_horizontal"]
    with pytest.raises(ValueError, match="the plan places 2 Linear layers, the Sequential has 5"):
        segments(seq, SplitPlan([F(), F()], 2))
    with pytest.raises(ValueError, match=r"fc1 \(16 -> 4, module 2 of the Sequential\) and fc2 break the "
                                         r"co-partition rule"):
        segments(seq, SplitPlan([F(), F("ps", "vertical", pair=True), F("ps", "horizontal"), F(), F()], 2))
    with pytest.raises(ValueError, match=r"fc0 \(6 -> 16, module 0 of the Sequential\) is paired: it must be split vertically "
                                         r"and the next Linear horizontally"):
        segments(seq, SplitPlan([F("ps", "vertical", pair=True), F("ps", "vertical"), F(), F(), F()], 2))
    with pytest.raises(ValueError, match=r"fc4 \(3 -> 1, module 7 of the Sequential\): its output width of 1 cannot be "
                                         r"split over 3 group PSs"):
        segments(seq, SplitPlan([F(), F(), F(), F(), F("ps", "vertical")], 3))
    with pytest.raises(ValueError, match="fc4 .* is paired but is the last Linear"):
        segments(seq, SplitPlan([F(), F(), F(), F(), F("ps", "vertical", pair=True)], 1))
    with pytest.raises(ValueError, match=r"fc0 .*: ps 2 out of range \[0, 2\)"):
        segments(seq, SplitPlan([F("ps", "none", ps=2), F(), F(), F(), F()], 2))
    with pytest.raises(ValueError, match="fc0 .* runs on the trainer, so it cannot be split"):
        segments(seq, SplitPlan([F("trainer", "vertical"), F(), F(), F(), F()], 2))
    with pytest.raises(TypeError, match="module 1 of the Sequential is Dropout"):
        segments(nn.Sequential(nn.Linear(2, 2), nn.Dropout()), SplitPlan([F()], 2))


def test_topk_streams_follow_the_batch_size():
    # A last, smaller batch has a top-k stream of its own (a residual is carried between
    # tensors of one shape only), and the codec acts on both ways of the wire.
    _, tr, servers = _local("vertical_horizontal", {"activations": "topk:0.25", "gradients": "topk:0.25"})
    for rows in (8, 8, 3):
        x = torch.randn(rows, 6, requires_grad=True)
        tr(x).sum().backward()
        tr.ps_step()
    t = tr.counter.as_dict()
    assert 0 < t["activations"]["after"] < t["activations"]["before"]
    assert 0 < t["gradients"]["after"] < t["gradients"]["before"]


def test_topk_on_the_wire_carries_nothing_from_one_batch_to_the_next():
    # Activations and their gradients are a batch's examples, other ones every step: a
    # top-k residual carried over added one batch's unsent values into the next batch's
    # (another example's), so the same input gave another output and input gradient
    # after any earlier batch. Now each message is sparsified on its own.
    spec = {"activations": "topk:0.25", "gradients": "topk:0.25"}
    _, tr, servers = _local("vertical_horizontal", spec)
    _, fresh, _ = _local("vertical_horizontal", spec)
    xs, labels = sc.inputs("vertical_horizontal", 6, 0)

    def output_and_dx(trainer):
        x = torch.from_numpy(xs).requires_grad_(True)
        y = trainer(x)
        sc.loss_of(y, labels).backward()
        return y.detach().numpy(), x.grad.numpy()

    torch.manual_seed(0)
    tr(torch.randn(8, 6)).sum().backward()  # an earlier batch of the same shape
    with torch.no_grad():
        tr(torch.randn(8, 6))  # and an evaluation
    y, dx = output_and_dx(tr)
    y0, dx0 = output_and_dx(fresh)  # no batch before it
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(dx, dx0)
    # The codec did act (three values in four dropped), each way of the wire.
    t = tr.counter.as_dict()
    assert 0 < t["activations"]["after"] < t["activations"]["before"]
    assert 0 < t["gradients"]["after"] < t["gradients"]["before"]


class _ClockedPs:
    """A trainer's view of group PSs over MPI, on a clock that only sleeping moves
    (hps.distributed.poll's time, patched): a PS answers a request `answer_after`
    clock seconds after it was posted (None: never). No thread, no real waiting, so
    a bound is tested exactly, whatever the machine's load."""

    def __init__(self, answer_after: dict):
        self.now = 0.0
        self.answer_after = answer_after  # request op -> seconds, or None
        self.posted: list = []            # (rank, tag, op, at)

    # time, as poll uses it
    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    # the communicator, as MpiTransport and poll use it
    def send(self, msg, dest, tag):
        self.posted.append((dest, tag, msg[0], self.now))

    def improbe(self, source, tag, status=None):
        for i, (rank, t, op, at) in enumerate(self.posted):
            after = self.answer_after[op]
            if rank == source and t == tag and after is not None and self.now >= at + after:
                del self.posted[i]
                return type("Message", (), {"recv": lambda self, op=op: f"{op} done"})()
        return None


@pytest.fixture
def clocked(monkeypatch):
    from hps.distributed import poll

    def make(answer_after):
        ps = _ClockedPs(answer_after)
        monkeypatch.setattr(poll, "time", ps)
        return ps
    return make


class _ClockedCollective:
    """An MPI request of a collective that completes at its `rounds`-th test (MPI
    advances a collective only while its rank calls in: a round a test; None:
    never), on a clock that sleeping and each test (1 us) move (hps.distributed.
    poll's time, patched)."""

    def __init__(self, rounds):
        self.now, self.slept, self.tests, self.rounds = 0.0, 0.0, 0, rounds

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds

    def Test(self) -> bool:
        self.now += 1e-6
        self.tests += 1
        return self.rounds is not None and self.tests >= self.rounds


def test_a_collective_runs_its_rounds_back_to_back_and_sleeps_while_it_waits(monkeypatch):
    # hps.distributed.poll.wait, which a hierarchical job's all-reduces and broadcasts
    # go through. Their peers present, a collective of 20 rounds completes without a
    # pause: a pause after every test made each round wait one (a 128 KiB all-reduce
    # of two ranks took 12 ms instead of 1).
    from hps.distributed import poll
    request = _ClockedCollective(rounds=20)
    monkeypatch.setattr(poll, "time", request)
    poll.wait(request, timeout=1.0)
    assert request.tests == 20 and request.slept == 0
    # Nor one that takes most of YIELD_FOR (a peer descheduled a while): the first
    # YIELD_FOR is tested back to back, as a blocking collective waits.
    rounds = int(0.9 * poll.YIELD_FOR / 1e-6)
    request = _ClockedCollective(rounds=rounds)
    monkeypatch.setattr(poll, "time", request)
    poll.wait(request, timeout=1.0)
    assert request.tests == rounds and request.slept == 0
    # One that never completes: past YIELD_FOR, bursts of tests between pauses that
    # sleep most of the rest of the wait (no spinning core), then the caller's error
    # at the timeout.
    request = _ClockedCollective(rounds=None)
    monkeypatch.setattr(poll, "time", request)
    with pytest.raises(RuntimeError, match="the all-reduce is late"):
        poll.wait(request, timeout=0.2, expired=lambda: RuntimeError("the all-reduce is late"))
    assert 0.2 <= request.now < 0.2 + poll.LONGEST_PAUSE + 2 * poll.BURST
    assert request.slept > 0.8 * (request.now - poll.YIELD_FOR) and request.tests > 1000
    # A timeout shorter than YIELD_FOR is kept.
    request = _ClockedCollective(rounds=None)
    monkeypatch.setattr(poll, "time", request)
    with pytest.raises(RuntimeError, match="late"):
        poll.wait(request, timeout=0.005, expired=lambda: RuntimeError("late"))
    assert 0.005 <= request.now < 0.005 + poll.LONGEST_PAUSE + 2 * poll.BURST


def _clocked_trainer(ps, timeout):
    from hps.hierarchical.split_mlp import MpiTransport
    seq = nn.Sequential(nn.Linear(4, 2))
    return SplitTrainer(seq, SplitPlan.all_trainer(seq, 2), MpiTransport(ps, [5, 6], timeout=timeout))


def test_the_end_of_training_waits_for_a_group_ps_busy_with_its_last_average(clocked):
    # A group PS answers "finish" after its averaging's finish, which waits on the
    # centre up to `timeout` for the exchange in flight and again for its stop: 1.5 x
    # timeout is within its own bounds. The trainer waited one timeout and failed the
    # job, blaming the PS ("did not answer the end of training within 1 s").
    ps = clocked({"finish": 1.5, "step": 0.0})
    tr = _clocked_trainer(ps, timeout=1.0)
    tr.ps_finish()
    assert ps.now >= 1.5 and not ps.posted


def test_a_group_ps_that_never_finishes_fails_the_trainer_after_the_finish_bound(clocked):
    from hps.hierarchical.split_mlp import FINISH_WAITS, GroupPsTimeout
    ps = clocked({"finish": None, "step": None})
    tr = _clocked_trainer(ps, timeout=1.0)
    with pytest.raises(GroupPsTimeout, match=r"group PS 0 \(rank 5\) did not answer the end of training \(its last "
                                             rf"averaging, allowed {FINISH_WAITS} x the timeout\) within 3 s"):
        tr.ps_finish()
    assert FINISH_WAITS == 3 and 3.0 <= ps.now < 3.1
    # Every other wait keeps the timeout itself.
    ps.now, ps.posted = 0.0, []
    with pytest.raises(GroupPsTimeout, match=r"group PS 0 \(rank 5\) did not answer the optimizer step within 1 s"):
        tr.ps_step()
    assert 1.0 <= ps.now < 1.1


def test_a_value_the_codec_would_carry_as_an_infinity_is_refused_before_it_is_sent():
    """Activations and gradients crossed to and from the group PSs unchecked: a
    finite value past 3.396e38 went through the bf16 codec as an infinity (and
    one past float32's range through any), and the group PS's weights, or the
    trainer's, stepped with it (NaN, caught a batch later by the loss). Now the
    sender refuses it, naming the segment and where: the trainer before it
    sends, a group PS with its refusal as the answer, which the trainer raises."""
    from hps.errors import DivergedError

    def local(codecs):
        seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        with torch.no_grad():
            seq[0].weight.copy_(torch.tensor([[3.995, 0.0], [0.0, 1.0]]))
            seq[1].weight.fill_(1.0)
            for m in seq:
                m.bias.zero_()
        plan = SplitPlan([F("ps", "none", ps=0), F()], 1)
        server = GroupPsServer(seq, plan, 0, sc.make_optimizer, CodecStreams(codecs))
        return SplitTrainer(seq, plan, LocalTransport([server]), CodecStreams(codecs)), server

    bf16 = {"activations": "bf16", "gradients": "bf16"}
    # The trainer's input to the PS's layer: nothing leaves.
    tr, ps = local(bf16)
    with pytest.raises(DivergedError, match=r"^fc0: its input, for group PS\(s\) \[0\] holds 1 value that bfloat16 "
                                            r"rounds to an infinity .*\(index 1 first: 3\.4e\+38\): training diverged "
                                            r"\(\[hierarchical\] activations = 'bf16' carries such values"):
        tr(torch.tensor([[1.0, 3.4e38]]))
    assert ps.saved == {} and tr.counter.as_dict()["activations"]["before"] == 0
    # The PS's output (3.995 x 2^126 = 3.3985e38, finite in float32): its refusal is the answer.
    tr, ps = local(bf16)
    with pytest.raises(DivergedError, match=r"^group PS 0, fc0: its output for rank 0 holds 1 value that bfloat16 "
                                            r"rounds to an infinity .*\(index 0 first: 3\.3985.*e\+38\)"):
        tr(torch.tensor([[2.0 ** 126, 1.0]]))
    assert ps.saved == {}
    # Under no codec, a float32 infinity (3.995 x 2e38).
    tr, ps = local({})
    with pytest.raises(DivergedError, match=r"^group PS 0, fc0: its output for rank 0 holds 1 value that is not "
                                            r"finite \(index 0 first: inf\).*activations = 'none'"), \
            np.errstate(over="ignore"):
        tr(torch.tensor([[2e38, 1.0]]))
    # The trainer's gradient of the PS's output (the loss's 3.4e38 through weights of 1): nothing leaves.
    tr, ps = local(bf16)
    out = tr(torch.tensor([[1.0, 1.0]]))
    with pytest.raises(DivergedError, match=r"^fc0: the gradient of its output, for group PS\(s\) \[0\] holds 2 "
                                            r"values that bfloat16 rounds .*gradients = 'bf16'"):
        out.backward(torch.tensor([[3.4e38]]))
    assert all(p.grad is None or torch.equal(p.grad, torch.zeros_like(p)) for p in ps.optimizer.params)
    # The PS's gradient of its input (3.995 x 2^126): its refusal is the answer.
    tr, ps = local(bf16)
    x = torch.tensor([[1.0, 1.0]], requires_grad=True)
    out = tr(x)
    with pytest.raises(DivergedError, match=r"^group PS 0, fc0: the gradient of its input for rank 0 holds 1 value "
                                            r"that bfloat16 rounds"):
        out.backward(torch.tensor([[2.0 ** 126]]))
    assert x.grad is None
