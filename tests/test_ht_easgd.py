"""hps.hierarchical.easgd against a NumPy transcription of EASGD (Zhang, Choromanska
and LeCun 2015) written here from the paper's equations, for 2 and 3 groups."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from hps.hierarchical.easgd import Easgd, EasgdConfig

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ht_scenarios.py")
_spec = importlib.util.spec_from_file_location("ht_scenarios", SCRIPT)
sc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sc)
ETA = sc.ETA
grad = sc.easgd_grad  # the groups' gradients, shared with the ranks of the MPI scenarios
MPIEXEC = shutil.which("mpiexec")
needs_mpi = pytest.mark.skipif(MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
                               reason="needs mpi4py and mpiexec (pip install '.[mpi]')")


def reference_sync(x0, G, alpha, tau, steps):
    """Synchronous EASGD, the paper's eqs. (5)-(6) applied every tau steps with
    eta*rho = alpha:  x_i <- x_i - alpha (x_i - xt);  xt <- xt + alpha sum_i (x_i - xt),
    both from the values before the round; SGD steps x_i <- x_i - eta g_i otherwise."""
    x = [x0.astype(np.float64).copy() for _ in range(G)]
    xt = x0.astype(np.float64).copy()
    for t in range(1, steps + 1):
        for i in range(G):
            x[i] = x[i] - ETA * grad(i, t, x[i].astype(np.float32))
        if t % tau == 0:
            old = [xi.copy() for xi in x]
            x = [xi - alpha * (xi - xt) for xi in old]
            xt = xt + alpha * sum(xi - xt for xi in old)
    return x, xt


def reference_async(x0, G, alpha, tau, steps):
    """Asynchronous EASGD (the paper's Algorithm 1), workers visiting the master in
    the order 0..G-1 at each step where t mod tau == 0: worker i reads xt, computes
    e = alpha (x_i - xt), sets x_i <- x_i - e, the master sets xt <- xt + e."""
    x = [x0.astype(np.float64).copy() for _ in range(G)]
    xt = x0.astype(np.float64).copy()
    for t in range(1, steps + 1):
        for i in range(G):
            x[i] = x[i] - ETA * grad(i, t, x[i].astype(np.float32))
            if t % tau == 0:
                e = alpha * (x[i] - xt)
                x[i] = x[i] - e
                xt = xt + e
    return x, xt


@pytest.mark.parametrize("G", [2, 3])
@pytest.mark.parametrize("tau", [1, 3])
def test_sync_rounds_match_the_paper(G, tau):
    x0 = np.linspace(0.5, -0.5, 12).astype(np.float32)
    alpha, steps = 0.3, 9
    e = Easgd(x0, G, EasgdConfig(alpha=alpha, period=tau, mode="sync"))
    xs = [x0.copy() for _ in range(G)]
    for t in range(1, steps + 1):
        for i in range(G):
            xs[i] -= np.float32(ETA) * grad(i, t, xs[i])
        if t % tau == 0:
            e.exchange_all(xs)
    ref_x, ref_c = reference_sync(x0, G, alpha, tau, steps)
    for i in range(G):
        np.testing.assert_allclose(xs[i], ref_x[i], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(e.centre, ref_c, rtol=1e-5, atol=1e-6)
    assert e.exchanges == G * (steps // tau)


@pytest.mark.parametrize("G", [2, 3])
@pytest.mark.parametrize("tau", [1, 2])
def test_async_exchanges_match_the_paper(G, tau):
    x0 = np.linspace(-0.3, 0.7, 10).astype(np.float32)
    alpha, steps = 0.2, 8
    e = Easgd(x0, G, EasgdConfig(alpha=alpha, period=tau))
    xs = [x0.copy() for _ in range(G)]
    exchanged = 0
    for t in range(1, steps + 1):
        for i in range(G):
            xs[i] -= np.float32(ETA) * grad(i, t, xs[i])
            exchanged += e.after_step(i, xs[i])
    ref_x, ref_c = reference_async(x0, G, alpha, tau, steps)
    for i in range(G):
        np.testing.assert_allclose(xs[i], ref_x[i], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(e.centre, ref_c, rtol=1e-5, atol=1e-6)
    assert exchanged == G * (steps // tau)
    # The replicas were pulled together: closer to each other than without averaging.
    spread = max(np.abs(x - y).max() for x in xs for y in xs)
    free = [x0.astype(np.float64).copy() for _ in range(G)]
    for t in range(1, steps + 1):
        for i in range(G):
            free[i] = free[i] - ETA * grad(i, t, free[i].astype(np.float32))
    assert spread < 0.8 * max(np.abs(f - h).max() for f in free for h in free)


def test_an_exchange_keeps_the_sum():
    e = Easgd(np.zeros(4, np.float32), 2, EasgdConfig(alpha=0.37))
    a, b = np.array([1, 2, 3, 4], np.float32), np.array([-4, 0, 1, 9], np.float32)
    before = a + b + e.centre
    e.exchange(1, b)
    e.exchange(0, a)
    np.testing.assert_allclose(a + b + e.centre, before, rtol=1e-6)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"alpha \(elasticity\) must be in \(0, 1\], got 0"):
        Easgd(np.zeros(2, np.float32), 2, EasgdConfig(alpha=0))
    with pytest.raises(ValueError, match="period must be an int >= 1, got 0"):
        EasgdConfig(period=0).check()
    with pytest.raises(ValueError, match="mode must be 'async' or 'sync', got 'bsp'"):
        EasgdConfig(mode="bsp").check()
    with pytest.raises(TypeError, match="centre must be a float32 numpy array, got float64"):
        Easgd(np.zeros(2), 2)
    e = Easgd(np.zeros(2, np.float32), 2)
    with pytest.raises(ValueError, match=r"group 2 out of range \[0, 2\)"):
        e.exchange(2, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match=r"group 1's replica must be float32 of shape \(2,\), got float32 \(3,\)"):
        e.exchange(1, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="3 replicas for 2 groups"):
        e.exchange_all([np.zeros(2, np.float32)] * 3)
    # A negative group indexed from the end: group -1 counted group 1's steps.
    with pytest.raises(ValueError, match=r"group -1 out of range \[0, 2\)"):
        e.after_step(-1, np.zeros(2, np.float32))
    assert e.steps == [0, 0]
    # TOML's `alpha = true` passed as an elasticity of 1 (each exchange moving a replica
    # all the way to the centre), and groups = True as one group.
    for alpha in (True, "0.1"):
        with pytest.raises(ValueError, match=rf"alpha \(elasticity\) must be in \(0, 1\], got {alpha!r}"):
            EasgdConfig(alpha=alpha).check()
    with pytest.raises(ValueError, match=r"groups must be an int >= 1, got True"):
        Easgd(np.zeros(2, np.float32), True)


def _mpirun(n, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    p = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, SCRIPT, *map(str, args)], capture_output=True,
                       text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-4000:]


@needs_mpi
@pytest.mark.parametrize("G", [2, 3])
def test_sync_rounds_between_ranks_match_the_paper(tmp_path, G):
    _mpirun(G + 1, "easgd_sync", tmp_path)
    ref_x, ref_c = reference_sync(sc.EASGD_X0, G, 0.3, 2, 6)
    for g in range(G):
        got = np.load(tmp_path / f"group{g}.npz")
        np.testing.assert_allclose(got["x"], ref_x[g], rtol=1e-5, atol=1e-6, err_msg=f"group {g}")
        assert int(got["exchanges"]) == 3
    centre = np.load(tmp_path / "centre.npz")
    np.testing.assert_allclose(centre["centre"], ref_c, rtol=1e-5, atol=1e-6)
    assert int(centre["exchanges"]) == 3 * G


@needs_mpi
def test_background_exchanges_pull_groups_together_and_keep_the_sum(tmp_path):
    _mpirun(3, "easgd_background", tmp_path)
    xs = [np.load(tmp_path / f"group{g}.npz") for g in range(2)]
    centre = np.load(tmp_path / "centre.npz")
    done = [int(x["exchanges"]) for x in xs]
    assert all(1 <= n <= 10 for n in done) and int(centre["exchanges"]) == sum(done)
    # Groups started at 1 and 2 and the centre at 0 (sum 3 a value); exchanges move value
    # between them without making any (bf16 on the wire: both sides move by what it
    # delivers) and narrow the gap.
    total = xs[0]["x"] + xs[1]["x"] + centre["centre"]
    np.testing.assert_allclose(total, 3.0, rtol=1e-6)
    assert np.abs(xs[1]["x"] - xs[0]["x"]).max() < 1.0
    before, after = centre["bytes"]
    assert after * 2 == before > 0  # the centre's answers went as bf16


def reference_groups(x0, G, T, alpha, tau, steps):
    """Synchronous EASGD of G group replicas, each stepped by the mean of its T
    trainers' gradients (trainer i = g * T + t: grad(i, step, x)), as a group's
    all-reduce gives; the round as in reference_sync."""
    x = [x0.astype(np.float64).copy() for _ in range(G)]
    xt = x0.astype(np.float64).copy()
    for s in range(1, steps + 1):
        for g in range(G):
            xf = x[g].astype(np.float32)
            x[g] = x[g] - ETA * np.mean([grad(g * T + t, s, xf) for t in range(T)], axis=0)
        if s % tau == 0:
            old = [xi.copy() for xi in x]
            x = [xi - alpha * (xi - xt) for xi in old]
            xt = xt + alpha * sum(xi - xt for xi in old)
    return x, xt


@needs_mpi
@pytest.mark.parametrize("G,T,tau", [(2, 2, 1), (3, 2, 2)])
def test_groups_of_several_trainers_match_the_model(tmp_path, G, T, tau):
    # Trainer 0 of each group exchanges with the centre; GroupAverage broadcasts the
    # correction to the group's other trainer, which must apply it at the same step:
    # every copy ends bitwise equal to its group's trainer 0 and equal to the model.
    _mpirun(G * T + 1, "easgd_groups", tmp_path, T, tau)
    steps, alpha = sc.EASGD_GROUP_STEPS, sc.EASGD_GROUP_ALPHA
    ref_x, ref_c = reference_groups(sc.EASGD_X0, G, T, alpha, tau, steps)
    for g in range(G):
        first = np.load(tmp_path / f"trainer{g * T}.npz")
        assert int(first["exchanges"]) == steps // tau
        np.testing.assert_allclose(first["x"], ref_x[g], rtol=1e-5, atol=1e-6, err_msg=f"group {g}")
        for t in range(1, T):
            peer = np.load(tmp_path / f"trainer{g * T + t}.npz")
            assert int(peer["corrections"]) == int(first["corrections"]) == steps // tau
            assert peer["x"].tobytes() == first["x"].tobytes(), f"group {g}: trainer {t} drifted from trainer 0"
    np.testing.assert_allclose(np.load(tmp_path / "centre.npz")["centre"], ref_c, rtol=1e-5, atol=1e-6)


class _Mailbox:
    """In-process point-to-point messages between threads standing for ranks: what
    EasgdCentre and EasgdClient use of an mpi4py communicator (send, improbe),
    payloads copied as MPI would."""

    ANY_SOURCE = -1

    def __init__(self):
        import threading
        self.lock = threading.Lock()
        self.queues: dict = {}

    def comm(self, rank: int):
        box = self

        class Comm:
            def send(self, obj, dest, tag):
                import copy
                with box.lock:
                    box.queues.setdefault(dest, []).append((rank, tag, copy.deepcopy(obj)))

            def improbe(self, source, tag, status=None):
                with box.lock:
                    q = box.queues.setdefault(rank, [])
                    for i, (src, t, obj) in enumerate(q):
                        if source in (src, box.ANY_SOURCE) and t == tag:
                            del q[i]
                            if status is not None:
                                status.source = src
                            return type("Message", (), {"recv": lambda self, obj=obj: obj})()
                return None

        return Comm()

    def empty(self, rank: int) -> bool:
        with self.lock:
            return not self.queues.get(rank)


@pytest.fixture
def mailbox(monkeypatch):
    """A fake mpi4py.MPI (ANY_SOURCE, Status) for EasgdCentre.serve, whatever is installed."""
    import types
    box = _Mailbox()

    class Status:
        source = None

        def Get_source(self):
            return self.source

    mpi = types.SimpleNamespace(ANY_SOURCE=box.ANY_SOURCE, Status=Status)
    monkeypatch.setitem(sys.modules, "mpi4py", types.SimpleNamespace(MPI=mpi))
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    return box


def serving(centre, daemon: bool = False):
    """centre.serve() in a thread: (the thread, a dict its result lands in, under
    "centre", or its error, under "error")."""
    import threading
    served: dict = {}

    def serve():
        try:
            served["centre"] = centre.serve(timeout=5.0)
        except BaseException as e:  # noqa: BLE001 - the caller checks it
            served["error"] = e

    t = threading.Thread(target=serve, daemon=daemon)
    t.start()
    return t, served


def test_sync_centre_finishes_a_round_when_a_group_stops_while_another_waits(mailbox):
    # Group 0 stops after one round; group 1 has sent its second exchange before group
    # 0's stop reaches the centre. That round is group 1's alone now: the centre must
    # answer it, not wait (until its timeout) for an exchange group 0 will never send.
    import threading
    import time
    from hps.hierarchical.easgd import EasgdCentre, EasgdClient
    cfg = EasgdConfig(alpha=0.5, mode="sync")
    centre = EasgdCentre(mailbox.comm(2), np.zeros(3, np.float32), [0, 1], cfg)
    clients = [EasgdClient(mailbox.comm(g), 2, g, cfg, timeout=5.0) for g in range(2)]
    xs = [np.full(3, 2.0, np.float32), np.full(3, 4.0, np.float32)]
    t, served = serving(centre)
    first = [threading.Thread(target=clients[g].exchange, args=(xs[g],)) for g in range(2)]
    for th in first:
        th.start()
    for th in first:
        th.join()
    # Round 1 from c = 0: d = (2, 4); the groups move to 1 and 2, the centre to 0.5 * 6 = 3.
    np.testing.assert_array_equal(xs[0], 1.0)
    np.testing.assert_array_equal(xs[1], 2.0)
    second_error: list = []

    def second_exchange():
        try:
            clients[1].exchange(xs[1])
        except BaseException as e:  # noqa: BLE001 - checked below
            second_error.append(e)

    second = threading.Thread(target=second_exchange)
    second.start()
    deadline = time.monotonic() + 5.0
    while not mailbox.empty(2) and time.monotonic() < deadline:  # the centre holds group 1's exchange
        time.sleep(0.001)
    clients[0].stop()
    second.join(timeout=10.0)
    assert not second.is_alive() and not second_error, second_error
    clients[1].stop()
    t.join(timeout=10.0)
    assert "error" not in served, served["error"]
    # Round 2, group 1 alone against c = 3: d = -1; group 1 to 2.5, the centre to 2.5.
    np.testing.assert_array_equal(xs[1], 2.5)
    np.testing.assert_array_equal(served["centre"], 2.5)
    assert centre.easgd.exchanges == 3


def test_a_topk_averaging_codec_is_refused():
    # An exchange sends the replica: top-k of it reads as zeros at the centre for the
    # values left out, so d = -c there and the centre is pulled to zero. Shown on the
    # two halves of one exchange, then refused where the exchanges are made.
    from hps.hierarchical.codecs import CodecStreams, decode
    from hps.hierarchical.easgd import EasgdCentre, EasgdClient
    x = np.arange(1, 9, dtype=np.float32)
    e = Easgd(x.copy(), 2, EasgdConfig(alpha=0.5))
    sent = decode(CodecStreams({"averaging": "topk:0.25"}).get("averaging", 0).encode(x))
    e.difference(0, sent)
    assert np.abs(e.centre - x).max() >= 2.0  # the centre moved although the replica equals it
    codecs = CodecStreams({"averaging": "topk:0.25"})
    with pytest.raises(ValueError, match="averaging = 'topk:0.25': top-k cannot compress an EASGD exchange"):
        EasgdClient(None, 1, 0, EasgdConfig(), codecs)
    with pytest.raises(ValueError, match="averaging = 'topk:0.25': top-k cannot compress an EASGD exchange"):
        EasgdCentre(None, x, [0, 1], EasgdConfig(), codecs)
    EasgdClient(None, 1, 0, EasgdConfig(), CodecStreams({"averaging": "bf16"}))  # the others are fine


@pytest.mark.parametrize("group", [5, -1])
def test_the_centre_names_a_group_index_out_of_range(mailbox, group):
    # Group 5 of 2 raised a bare IndexError; -1 was taken for the last group's rank.
    from hps.hierarchical.easgd import EasgdCentre
    centre = EasgdCentre(mailbox.comm(2), np.zeros(3, np.float32), [0, 1], EasgdConfig(alpha=0.5))
    from hps.hierarchical.easgd import _TAG
    mailbox.comm(1).send(("exchange", group, None), dest=2, tag=_TAG)
    with pytest.raises(ValueError, match=rf"rank 1 spoke as group {group}, not one of the 2 groups \[0, 2\)"):
        centre.serve(timeout=5.0)


def test_a_background_correction_keeps_the_steps_taken_while_it_was_in_flight():
    # The thread only reads the live replica (its snapshot may mix two steps' weights:
    # a stale read, by design); the correction from that snapshot is added at a later
    # step boundary, on the owner's thread, to the replica as it is then. An exchange
    # held open by the client (a seam, no timing) spans one optimizer step: that step
    # survives the correction, and the correction is the snapshot's.
    import threading
    from hps.hierarchical.easgd import BackgroundEasgd, GroupAverage

    class HeldClient:
        config, group, exchanges = EasgdConfig(alpha=0.5, period=1), 0, 0

        def __init__(self):
            self.sent, self.release = threading.Event(), threading.Event()
            self.snapshots: list = []

        def exchange(self, x, apply_to):  # the centre at 0: d = x
            self.snapshots.append(x.copy())
            self.sent.set()
            assert self.release.wait(10)
            apply_to -= np.float32(self.config.alpha) * x
            self.exchanges += 1

        def stop(self):
            pass

    client = HeldClient()
    live = np.full(4, 2.0, np.float32)
    bg = BackgroundEasgd(client, live)
    avg = GroupAverage(live, bg)
    avg.step()                      # after step 1: the thread snapshots 2.0
    assert client.sent.wait(10)
    live += 1.0                     # step 2's in-place write, the exchange still in flight
    avg.step()                      # nothing to land yet
    np.testing.assert_array_equal(live, 3.0)
    client.release.set()
    bg.wait_idle()                  # the correction -0.5 * 2.0 is ready, not yet applied
    np.testing.assert_array_equal(live, 3.0)
    live += 1.0                     # step 3
    avg.step()                      # lands on 4.0: both steps kept, the pull the snapshot's
    np.testing.assert_array_equal(live, 3.0)
    np.testing.assert_array_equal(client.snapshots[0], 2.0)
    assert avg.corrections == 1
    avg.finish()


def test_a_centre_part_that_fails_fails_the_centre_at_once(mailbox):
    # The centre serves each part of the model (the trainers' layers, each group PS's
    # blocks) from a thread of its own. A part whose thread failed (here: a rank that
    # speaks as another group) was reported only once every other part had ended,
    # and they serve until the job releases them: the centre kept serving, its error
    # unsaid, while the failed part's groups waited for answers until their timeout
    # and ended the job saying the centre had died or hung.
    import threading
    from hps.hierarchical.easgd import _TAG
    from hps.hierarchical.roles import HierarchicalConfig, Roles, _serve_centre
    cfg = HierarchicalConfig(groups=2, group_ps=1, timeout=5.0)
    roles = Roles.layout(5, 4, cfg)  # trainers 0 and 2, group PSs 1 and 3, the centre 4
    other = _Mailbox()  # part 1's communicator (part 0's: the fixture's)
    comms = [mailbox.comm(4), other.comm(4)]
    mailbox.comm(0).send({"centre": np.zeros(3, np.float32), "exchanges": 0}, dest=4, tag=40)
    other.comm(1).send({"centre": np.zeros(2, np.float32), "exchanges": 0}, dest=4, tag=40)
    mailbox.comm(2).send(("exchange", 0, None), dest=4, tag=_TAG)  # rank 2 is group 1's trainer
    result: dict = {}

    def centre():
        try:
            result["summary"] = _serve_centre(roles, cfg, comms)
        except BaseException as e:  # noqa: BLE001 - checked below
            result["error"] = e

    t = threading.Thread(target=centre, daemon=True)
    t.start()
    try:
        t.join(timeout=30.0)  # (a hang guard: part 1 serves on until released)
        assert not t.is_alive(), "the centre went on serving after part 0 failed"
        assert isinstance(result.get("error"), ValueError), result
        assert "EASGD centre: rank 2 spoke as group 0 (rank 0)" in str(result["error"])
    finally:  # part 1's groups stop and the job releases it: its thread ends
        for rank, group in ((1, 0), (3, 1)):
            other.comm(rank).send(("stop", group, None), dest=4, tag=_TAG)
        other.comm(0).send(("release", None, None), dest=4, tag=_TAG)
        t.join(timeout=30.0)


@pytest.mark.parametrize("codec", ["int8", "bf16"])
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_an_exchange_through_a_lossy_codec_keeps_the_sum(mailbox, codec, mode):
    # The centre answers d = x - c through the averaging codec; the group applies
    # x -= alpha d' (d' what the codec delivers of d). The centre moved by alpha d, not
    # d': with int8 or bf16 every exchange made or lost alpha (d - d') of the model (up
    # to alpha max|d| / 254 a value with int8), where what one side loses the other
    # must gain. Both sides now move by the same d'.
    import threading
    from hps.hierarchical.codecs import CodecStreams
    from hps.hierarchical.easgd import EasgdCentre, EasgdClient
    cfg = EasgdConfig(alpha=0.5, mode=mode)
    codecs = CodecStreams({"averaging": codec})
    c0 = np.array([0.3, -0.1, 0.0, 2.0, 1e-3], np.float32)
    centre = EasgdCentre(mailbox.comm(1), c0, [0], cfg, codecs)
    client = EasgdClient(mailbox.comm(0), 1, 0, cfg, CodecStreams({"averaging": codec}), timeout=5.0)
    t, served = serving(centre, daemon=True)
    x = np.array([4.0, 0.013, -0.77, 1.0 / 3, 1e-3], np.float32)
    total = x.astype(np.float64) + c0
    for _ in range(3):
        client.exchange(x)
    client.stop()
    t.join(timeout=10.0)
    assert not t.is_alive() and "error" not in served, served
    assert centre.easgd.exchanges == 3
    assert not np.array_equal(x, np.array([4.0, 0.013, -0.77, 1.0 / 3, 1e-3], np.float32))  # (they moved)
    # (Up to float32 rounding of values below 4: 2**-22 each side.)
    np.testing.assert_allclose(x.astype(np.float64) + served["centre"], total, rtol=0, atol=2 * 2.0**-22)


def test_a_replica_that_bf16_rounds_to_an_infinity_is_refused_before_it_leaves(mailbox):
    # 3.4e38 is a finite float32, but past bfloat16's largest finite value: the bf16
    # averaging codec carried it to the centre as inf, which made the centre inf (and
    # its snapshot, which checkpoints hold) and the group's replica -inf, with no
    # error. The group refuses it now, naming the value, before it leaves; a NaN in
    # the replica alike, under any codec. Nothing moves.
    from hps.errors import DivergedError
    from hps.hierarchical.codecs import CodecStreams
    from hps.hierarchical.easgd import EasgdCentre, EasgdClient
    cfg = EasgdConfig(alpha=0.5)
    c0 = np.zeros(4, np.float32)
    centre = EasgdCentre(mailbox.comm(1), c0, [0], cfg, CodecStreams({"averaging": "bf16"}))
    client = EasgdClient(mailbox.comm(0), 1, 0, cfg, CodecStreams({"averaging": "bf16"}), timeout=5.0)
    t, served = serving(centre, daemon=True)
    x = np.array([1.0, 3.4e38, -2.0, 0.5], np.float32)
    kept = x.copy()
    with pytest.raises(DivergedError, match=r"^EASGD exchange of group 0: the replica holds 1 value that bfloat16 "
                                            r"rounds to an infinity \(past 3.396177e\+38\) or that is not a number "
                                            r"\(index 1 first: 3.4e\+38\): training diverged \(\[hierarchical\] "
                                            r"averaging = 'bf16' carries such values to the centre"):
        client.exchange(x)
    x[3] = np.nan
    with pytest.raises(DivergedError, match=r"the replica holds 2 values that bfloat16 rounds .* \(index 1 first"):
        client.exchange(x)
    plain = EasgdClient(mailbox.comm(0), 1, 0, cfg, timeout=5.0)
    with pytest.raises(DivergedError, match=r"the replica holds 1 value that is not finite \(index 3 first: nan\)"):
        plain.exchange(np.where(np.isnan(x), x, kept))
    np.testing.assert_array_equal(x[:3], kept[:3])
    client.stop()
    t.join(timeout=10.0)
    assert not t.is_alive() and "error" not in served, served
    np.testing.assert_array_equal(served["centre"], c0)
    assert centre.easgd.exchanges == 0


@pytest.mark.parametrize("codec", ["none", "bf16"])
def test_a_difference_from_the_centre_that_is_not_finite_is_refused_by_the_centre(mailbox, codec):
    # The replica and the centre are finite, but 3e38 - (-3e38) is not (and 3.3e38 -
    # (-1e37), bf16 rounds to inf): the centre moved to inf and answered inf, which
    # made the group's replica -inf. The centre refuses it now, before it moves, and
    # sends the refusal to the group, whose exchange raises it too.
    from hps.errors import DivergedError
    from hps.hierarchical.codecs import CodecStreams
    from hps.hierarchical.easgd import EasgdCentre, EasgdClient
    cfg = EasgdConfig(alpha=0.5)
    c0 = np.array([0.0, -3e38 if codec == "none" else -1e37, 1.0], np.float32)
    centre = EasgdCentre(mailbox.comm(1), c0, [0], cfg, CodecStreams({"averaging": codec}))
    client = EasgdClient(mailbox.comm(0), 1, 0, cfg, CodecStreams({"averaging": codec}), timeout=5.0)
    t, served = serving(centre, daemon=True)
    x = np.array([1.0, 3e38 if codec == "none" else 3.3e38, 2.0], np.float32)
    sent = x.copy()
    said = r"that is not finite" if codec == "none" else r"that bfloat16 rounds to an infinity"
    refused = rf"^EASGD centre, the exchange of group 0 \(rank 0\): its difference from the centre holds 1 value {said}"
    with pytest.raises(DivergedError, match=refused):
        client.exchange(x)
    t.join(timeout=10.0)
    assert not t.is_alive()
    assert isinstance(served.get("error"), DivergedError) and re.match(refused, str(served["error"])), served
    np.testing.assert_array_equal(x, sent)
    np.testing.assert_array_equal(centre.easgd.centre, c0)
    assert centre.easgd.exchanges == 0


def test_a_finished_average_keeps_its_exchanges_and_phase_for_a_resumed_run():
    # A run's last checkpoint comes after its averaging finished; a finished run is
    # resumed to train further (hps train --resume with more examples). That checkpoint
    # held no background state: the resumed run counted its exchanges from 0 again
    # (beside the corrections, which it kept: a summary of 1 exchange and 3
    # corrections) and restarted the period, the next exchange a period after the
    # resume rather than where the run left it.
    from hps.hierarchical.easgd import BackgroundEasgd, GroupAverage

    class Client:  # the centre at 0: d = x
        config, group = EasgdConfig(alpha=0.5, period=2), 0

        def __init__(self):
            self.exchanges = 0

        def exchange(self, x, apply_to):
            apply_to -= np.float32(self.config.alpha) * x
            self.exchanges += 1

        def stop(self):
            pass

    live = np.full(3, 8.0, np.float32)
    first = GroupAverage(live, BackgroundEasgd(Client(), live, wait=True))
    for _ in range(5):  # exchanges after steps 2 and 4
        first.step()
    first.finish()
    assert (first.background.client.exchanges, first.corrections) == (2, 2)
    state = first.state_dict()  # (the final checkpoint's)

    resumed = GroupAverage(live, BackgroundEasgd(Client(), live, wait=True))
    resumed.load_state_dict(state)
    assert (resumed.background.client.exchanges, resumed.corrections) == (2, 2)
    resumed.step()  # step 6: the period's phase goes on from step 5
    assert (resumed.background.client.exchanges, resumed.corrections) == (3, 3)
    resumed.finish()


def test_a_synchronous_average_whose_sum_overflows_is_refused_before_the_replica_changes(monkeypatch):
    """AllreduceAverage summed the groups' replicas in float32, in place: finite
    values (3e38 in each of two groups) summed to an infinity, and every group's
    replica went inf; a NaN of one group's went to all. Every rank holds the same
    sum and refuses it now, alike, naming the average and the value, before its
    replica changes."""
    from hps.errors import DivergedError
    from hps.hierarchical import easgd

    class TwoGroups:  # the communicator of two groups holding equal replicas
        def Get_size(self):
            return 2

    def doubled(comm, buf, timeout, what, ranks=None):  # their sum
        buf *= np.float32(2.0)

    monkeypatch.setattr(easgd, "allreduce_within", doubled)
    live = np.array([1.0, 3e38, -3e38], np.float32)
    average = easgd.AllreduceAverage(live, TwoGroups(), period=1, ranks=[0, 4])
    with pytest.raises(DivergedError, match=r"^the synchronous average across groups \(average 1, over ranks "
                                            r"\[0, 4\]\): the mean of the groups' replicas holds 2 values that are "
                                            r"not finite \(index 1 first: inf\): training diverged \(finite values "
                                            r"of the groups can overflow"), np.errstate(over="ignore"):
        average.step()
    assert np.array_equal(live, np.array([1.0, 3e38, -3e38], np.float32)) and average.corrections == 0
    live[1:] = [np.nan, 2.0]  # a NaN of one group's
    with pytest.raises(DivergedError, match=r"holds 1 value that is not finite \(index 1 first: nan\)"):
        average.step()
    live[1] = 5.0
    average.step()  # finite: the mean of two equal replicas, where they were
    assert np.array_equal(live, np.array([1.0, 5.0, 2.0], np.float32)) and average.corrections == 1
