"""Elastic averaging (EASGD, Zhang, Choromanska and LeCun 2015) of G group replicas
with a centre, as Hierarchical Training runs it across groups.

With elasticity ``alpha`` (the paper's moving rate alpha = eta * rho) and period
``tau``, every tau local steps a group's replica x_g and the centre c pull towards
each other by the same amount:

    d   = x_g - c
    x_g <- x_g - alpha d
    c   <- c   + alpha d

``async`` (the paper's Algorithm 1, and ShadowSync's background threads): each
group does this with the centre on its own, in whatever order groups arrive; the
centre sees one group at a time. ``sync`` (the paper's equations 5-6 at period
tau): every group's d is taken against the same centre, then the centre moves by
alpha * sum_g d_g. Either way the sum of the replicas and the centre does not
change in an exchange (what one side loses the other gains), which the MPI tests
check where the arrival order is not fixed.

:class:`Easgd` is the update itself, on NumPy arrays (one process holding every
replica: the reference, and what the centre rank runs). Between ranks the centre
has a rank of its own (:class:`EasgdCentre`; one rank is simpler to reason about
than a centre sharded over the group PSs, and the exchange is one message each way
a period); a group's :class:`EasgdClient` exchanges with it, in the foreground or
from a :class:`BackgroundEasgd` thread while training goes on, and
:class:`GroupAverage` lands the thread's corrections on every copy of the group's
replica at one step boundary.

:class:`AllreduceAverage` is the plain synchronous alternative (``[hierarchical]
across = "allreduce"``): no centre and no elasticity; every ``period`` steps each
group's replica is replaced by the mean of all G replicas, an MPI all-reduce in the
training thread, so the groups hold one model after each average (and training
waits for it: what the background average avoids).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from hps.config import is_int, is_number
from hps.distributed import poll
from hps.errors import DivergedError, HpsError
from hps.hierarchical.codecs import ByteCounter, CodecStreams, decode, refuse_unsendable

__all__ = ["EasgdConfig", "Easgd", "EasgdCentre", "EasgdClient", "BackgroundEasgd", "GroupAverage", "AllreduceAverage",
           "CentreTimeout", "CollectiveTimeout", "AllreduceTimeout", "BroadcastTimeout", "allreduce_within",
           "bcast_within", "check_averaging_codec", "centre_state", "release_centre"]


@dataclass
class EasgdConfig:
    alpha: float = 0.1        # elasticity: the share of the difference each side moves per exchange
    period: int = 1           # local steps between a group's exchanges (tau)
    mode: str = "async"       # "async": one group at a time (background); "sync": all groups against one centre

    def check(self, source: str = "[hierarchical]") -> None:
        if not (is_number(self.alpha) and 0.0 < self.alpha <= 1.0):
            raise ValueError(f"{source}: alpha (elasticity) must be in (0, 1], got {self.alpha!r}")
        if not (is_int(self.period) and self.period >= 1):
            raise ValueError(f"{source}: period must be an int >= 1, got {self.period!r}")
        if self.mode not in ("async", "sync"):
            raise ValueError(f"{source}: mode must be 'async' or 'sync', got {self.mode!r}")


class Easgd:
    """The centre of G groups and the elastic update. Replicas are float32 arrays
    of the centre's shape, changed in place.

    >>> import numpy as np
    >>> e = Easgd(np.zeros(2, np.float32), groups=2, config=EasgdConfig(alpha=0.5))
    >>> x = np.array([2.0, 4.0], np.float32)
    >>> e.exchange(0, x); x.tolist(), e.centre.tolist()
    ([1.0, 2.0], [1.0, 2.0])
    """

    def __init__(self, centre: np.ndarray, groups: int, config: EasgdConfig | None = None):
        self.config = config or EasgdConfig()
        self.config.check()
        if not isinstance(centre, np.ndarray) or centre.dtype != np.float32:
            raise TypeError(f"Easgd: centre must be a float32 numpy array, got "
                            f"{getattr(centre, 'dtype', type(centre).__name__)}")
        if not (is_int(groups) and groups >= 1):
            raise ValueError(f"Easgd: groups must be an int >= 1, got {groups!r}")
        self.centre = centre.copy()
        self.groups = groups
        self.steps = [0] * groups
        self.exchanges = 0

    def _check(self, g: int, x: np.ndarray) -> None:
        if not 0 <= g < self.groups:
            raise ValueError(f"Easgd: group {g} out of range [0, {self.groups})")
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.shape != self.centre.shape:
            raise ValueError(f"Easgd: group {g}'s replica must be float32 of shape {self.centre.shape}, got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}")

    def difference(self, g: int, x: np.ndarray) -> np.ndarray:
        """The centre's half of an async exchange: d = x - c, c += alpha d; returns d
        for the group to apply (x -= alpha d). The centre rank runs this."""
        self._check(g, x)
        d = x - self.centre
        self.centre += np.float32(self.config.alpha) * d
        self.exchanges += 1
        return d

    def exchange(self, g: int, x: np.ndarray) -> None:
        """One async exchange of group g's replica x with the centre, x in place."""
        d = self.difference(g, x)
        x -= np.float32(self.config.alpha) * d

    def exchange_all(self, xs: Sequence[np.ndarray]) -> None:
        """One sync round: every replica against the same centre, in place."""
        if len(xs) != self.groups:
            raise ValueError(f"Easgd.exchange_all: {len(xs)} replicas for {self.groups} groups")
        for g, x in enumerate(xs):
            self._check(g, x)
        a = np.float32(self.config.alpha)
        ds = [x - self.centre for x in xs]
        for x, d in zip(xs, ds):
            x -= a * d
        total = ds[0].copy()
        for d in ds[1:]:
            total += d
        self.centre += a * total
        self.exchanges += len(xs)

    def after_step(self, g: int, x: np.ndarray) -> bool:
        """Counts a local step of group g (async mode); exchanges every `period`
        steps. Returns whether it exchanged."""
        self._check(g, x)  # (before the count: a negative g would count another group's step)
        self.steps[g] += 1
        if self.steps[g] % self.config.period:
            return False
        self.exchange(g, x)
        return True


# ---------------------------------------------------------------- between ranks


class CentreTimeout(HpsError):
    """The centre or a group did not answer an exchange within the timeout."""


def _wait(comm, source: int, tag: int, timeout: float, what: str):
    return poll.recv(comm, source, tag, timeout=timeout, expired=lambda: CentreTimeout(
        f"{what}: no answer from rank {source} within {timeout:g} s (it died or hung)"))


class CollectiveTimeout(HpsError):
    """A collective of a group's ranks did not complete within the timeout: a rank
    of it died, hung or stopped taking part."""


class AllreduceTimeout(CollectiveTimeout):
    """A group's all-reduce (the synchronous average across groups, a Hogwild net's
    gradients, the trainer-held layers' gradients) did not complete within the timeout."""


class BroadcastTimeout(CollectiveTimeout):
    """A group's broadcast (its trainers' first parameters, an average's correction,
    the Hogwild nets' replica) did not complete within the timeout."""


def _within(requests: list, timeout: Optional[float], error: type, what: str, how: str) -> None:
    """Waits for every one of `requests` (polled, hps.distributed.poll.wait) at most
    `timeout` seconds (None: for ever), then raises error("{what}: {how} did not
    complete ..."). A blocking collective whose peer had died or hung never returned,
    and the rank waited for ever, where every other wait of the job has a timeout.
    The operations are still in flight after the error (MPI cannot cancel a
    collective, and the buffers may still be written): the job ends."""
    poll.wait(requests, timeout=timeout, expired=lambda: error(
        f"{what}: {how} did not complete within {timeout:g} s (a rank died, hung or stopped taking part)"))


def _named(comm, ranks: Optional[Sequence[int]]) -> list:
    return list(ranks) if ranks is not None else list(range(comm.Get_size()))


def allreduce_within(comm, bufs, timeout: Optional[float], what: str, ranks: Optional[Sequence[int]] = None) -> None:
    """Sums `bufs` (an array, or a list of them: one all-reduce each, all in flight
    together) over `comm`, in place, as ``comm.Allreduce(MPI.IN_PLACE, buf)``, but
    waits at most `timeout` seconds (None: for ever), then raises AllreduceTimeout
    saying `what` and the ranks it waited on (`ranks`, as the caller numbers them;
    default the communicator's)."""
    from mpi4py import MPI
    bufs = [bufs] if isinstance(bufs, np.ndarray) else list(bufs)
    requests = [comm.Iallreduce(MPI.IN_PLACE, b, op=MPI.SUM) for b in bufs]
    _within(requests, timeout, AllreduceTimeout, what, f"the all-reduce over ranks {_named(comm, ranks)}")


def bcast_within(comm, bufs, root: int, timeout: Optional[float], what: str,
                 ranks: Optional[Sequence[int]] = None) -> None:
    """``comm.Bcast(buf, root=root)`` of `bufs` (an array, or a list of them: one
    broadcast each, all in flight together), waited as allreduce_within's; past
    `timeout`, BroadcastTimeout names `what`, the root and the ranks (as `ranks`
    numbers them)."""
    bufs = [bufs] if isinstance(bufs, np.ndarray) else list(bufs)
    requests = [comm.Ibcast(b, root=root) for b in bufs]
    named = _named(comm, ranks)
    _within(requests, timeout, BroadcastTimeout, what, f"the broadcast from rank {named[root]} over ranks {named}")


_TAG = 41
_SNAPSHOT_TAG = 42  # the centre's answer to a ("snapshot",)


def centre_state(comm, centre_rank: int, timeout: float) -> dict:
    """The centre's state_dict, asked over comm (no exchange of this rank in flight on it)."""
    comm.send(("snapshot", None, None), dest=centre_rank, tag=_TAG)
    return _wait(comm, centre_rank, _SNAPSHOT_TAG, timeout, "the EASGD centre's snapshot for a checkpoint")


def release_centre(comm, centre_rank: int) -> None:
    """Lets the centre's serve(until_released=True) end once its groups have stopped."""
    comm.send(("release", None, None), dest=centre_rank, tag=_TAG)


def check_averaging_codec(spec: str) -> None:
    """Refuses a top-k ``averaging`` codec. An exchange sends the replica itself and
    answers with d = x - c, neither an update that adds up over steps: top-k sends
    the replica's largest values and zeros for the rest, so the centre sees d = -c
    there and is pulled to zero (and the group with it), and error feedback would
    add an older replica's unsent values into the next one."""
    if isinstance(spec, str) and spec.partition(":")[0] == "topk":
        raise ValueError(f"averaging = {spec!r}: top-k cannot compress an EASGD exchange (it sends the replica, "
                         f"not an update: the values not sent would read as zeros); use 'bf16' or 'int8'")


class EasgdCentre:
    """The centre on a rank of its own: serves the groups' exchanges until each has
    said stop. ``async``: one group at a time, in the order they arrive; ``sync``:
    a round waits for every group that has not stopped, then answers all from one
    centre.

    A group sends its replica through the ``averaging`` codec; the centre returns
    d = x - c through it too; the group applies x -= alpha d' and the centre
    c += alpha d', d' what the codec delivers of d (d itself with ``none``), so that
    the sum of the replicas and the centre is kept through a lossy codec too."""

    def __init__(self, comm, x0: np.ndarray, group_ranks: Sequence[int], config: EasgdConfig,
                 codecs: Optional[CodecStreams] = None, counter: Optional[ByteCounter] = None):
        self.comm = comm
        self.ranks = list(group_ranks)
        self.easgd = Easgd(x0, len(self.ranks), config)
        self.codecs = codecs or CodecStreams()
        check_averaging_codec(self.codecs.spec["averaging"])
        self.counter = counter or ByteCounter()

    def _awaited(self, live: set, pending: dict) -> str:
        return ", ".join(f"group {g} (rank {self.ranks[g]})" for g in sorted(live - set(pending)))

    def serve(self, timeout: float = 600.0, until_released: bool = False) -> np.ndarray:
        """Returns the final centre. Answers a ("snapshot",) from any rank (the centre
        and its exchanges so far, for a checkpoint) at any time; `until_released`:
        goes on after every group stopped until a rank sends ("release",) (a job's last
        checkpoint comes after its groups' stop)."""
        from mpi4py import MPI
        live = set(range(len(self.ranks)))
        pending: dict = {}
        status = MPI.Status()
        released = not until_released
        while live or not released:
            op, g, enc = poll.recv(self.comm, MPI.ANY_SOURCE, _TAG, timeout=timeout, status=status, expired=lambda:
                                   CentreTimeout(f"EASGD centre: nothing from "
                                                 f"{self._awaited(live, pending) or 'the rank that releases it'} "
                                                 f"within {timeout:g} s"))
            src = status.Get_source()
            if op == "snapshot":
                self.comm.send(self.state_dict(), dest=src, tag=_SNAPSHOT_TAG)
                continue
            if op == "release":
                released = True
                continue
            if not (isinstance(g, int) and 0 <= g < len(self.ranks)):
                raise ValueError(f"EASGD centre: rank {src} spoke as group {g!r}, not one of the "
                                 f"{len(self.ranks)} groups [0, {len(self.ranks)})")
            if src != self.ranks[g]:
                raise ValueError(f"EASGD centre: rank {src} spoke as group {g} (rank {self.ranks[g]})")
            if op == "stop":
                live.discard(g)
                self.comm.send(None, dest=src, tag=_TAG)
            elif self.easgd.config.mode == "async":
                self.comm.send(self._answer(g, decode(enc), self.easgd.centre), dest=src, tag=_TAG)
                continue
            else:
                pending[g] = decode(enc)
            # A sync round once every live group has sent; checked after a stop too: the
            # groups already waiting make the round then (no more will come from the one
            # that stopped).
            if pending and len(pending) == len(live):
                self._round(pending)
        return self.easgd.centre

    def state_dict(self) -> dict:
        """The centre and its exchanges so far (a copy)."""
        return {"centre": self.easgd.centre.copy(), "exchanges": self.easgd.exchanges}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's centre (of this one's shape) and its exchanges."""
        centre = state["centre"]
        if not isinstance(centre, np.ndarray) or centre.dtype != np.float32 or centre.shape != self.easgd.centre.shape:
            raise ValueError(f"EASGD centre: the checkpoint's centre is {getattr(centre, 'dtype', type(centre))} "
                             f"{getattr(centre, 'shape', '')}, this part is float32 {self.easgd.centre.shape}")
        self.easgd.centre[...] = centre
        self.easgd.exchanges = int(state["exchanges"])

    def _round(self, pending: dict) -> None:
        """One sync round: every pending replica against the same centre, answered."""
        before = self.easgd.centre.copy()
        for h, xh in sorted(pending.items()):
            self.comm.send(self._answer(h, xh, before), dest=self.ranks[h], tag=_TAG)
        pending.clear()

    def _answer(self, g: int, x: np.ndarray, centre: np.ndarray):
        """The answer to group g's replica x, against `centre`: d = x - c through the
        averaging codec. The centre moves by alpha times what the group gets of d (its
        decoding), not d itself: with a lossy codec an exchange would otherwise make or
        lose alpha (d - d') of the model, where what one side loses the other gains.

        A d that is not finite (x and c finite, of opposite signs, past half float32's
        range), or that bf16 would round to an infinity, made the centre and then the
        group inf: refused (DivergedError) before the centre moves, and sent to the
        group as its answer, whose exchange raises it too."""
        e = self.easgd
        e._check(g, x)
        with np.errstate(over="ignore", invalid="ignore"):  # (refused just below)
            d = x - centre
        spec = self.codecs.spec["averaging"]
        try:
            refuse_unsendable(d, spec, f"EASGD centre, the exchange of group {g} (rank {self.ranks[g]}): its "
                                       f"difference from the centre", f"[hierarchical] averaging = {spec!r} carries "
                                       f"such values to the group, and the centre moves by them; it did not")
        except DivergedError as refused:
            self.comm.send(refused, dest=self.ranks[g], tag=_TAG)
            raise
        enc = self.counter.encode(self.codecs.get("averaging", ("centre", g)), "averaging", d)
        e.centre += np.float32(e.config.alpha) * decode(enc)
        e.exchanges += 1
        return enc


class EasgdClient:
    """A group's side: exchanges its replica (a float32 array, changed in place)
    with the centre."""

    def __init__(self, comm, centre_rank: int, group: int, config: EasgdConfig,
                 codecs: Optional[CodecStreams] = None, counter: Optional[ByteCounter] = None,
                 timeout: float = 600.0):
        config.check()
        self.comm, self.centre, self.group, self.config = comm, centre_rank, group, config
        self.codecs = codecs or CodecStreams()
        check_averaging_codec(self.codecs.spec["averaging"])
        self.counter = counter or ByteCounter()
        self.timeout = timeout
        self.exchanges = 0

    def exchange(self, x: np.ndarray, apply_to: Optional[np.ndarray] = None) -> None:
        """Sends x; applies -alpha d to `apply_to` (default x) when the centre answers.
        With a snapshot as x and the live parameters as apply_to, training goes on
        meanwhile (ShadowSync). DivergedError, before x leaves, where x holds a value
        that is not finite or that the bf16 codec would round to an infinity (the
        centre, then every group, would hold it), and where the centre refused the
        exchange (its difference from x not finite); x and apply_to unchanged."""
        spec = self.codecs.spec["averaging"]
        refuse_unsendable(x, spec, f"EASGD exchange of group {self.group}: the replica",
                          f"[hierarchical] averaging = {spec!r} carries such values to the centre, and from there "
                          f"to every group")
        enc = self.counter.encode(self.codecs.get("averaging", ("group", self.group)), "averaging", x)
        self.comm.send(("exchange", self.group, enc), dest=self.centre, tag=_TAG)
        answer = _wait(self.comm, self.centre, _TAG, self.timeout, f"EASGD exchange of group {self.group}")
        if isinstance(answer, DivergedError):  # the centre refused it (EasgdCentre._answer)
            raise answer
        d = decode(answer)
        target = x if apply_to is None else apply_to
        target -= np.float32(self.config.alpha) * d
        self.exchanges += 1

    def stop(self) -> None:
        self.comm.send(("stop", self.group, None), dest=self.centre, tag=_TAG)
        _wait(self.comm, self.centre, _TAG, self.timeout, f"EASGD stop of group {self.group}")


class BackgroundEasgd:
    """ShadowSync's scheme: a thread that, every `period` local steps (counted by
    :meth:`step_done`), snapshots the live replica, exchanges the snapshot with the
    centre and keeps the correction -alpha d for the owner to :meth:`take` at a step
    boundary, while training goes on. Give it a communicator of its own
    (``comm.Dup()``): its messages must not meet the training's.

    The thread never writes the live replica: a replica held by several ranks (a
    group's trainers) must change on all of them at the same step
    (:class:`GroupAverage` lands the correction there). A new exchange starts only
    once the previous correction was taken (and, by the owner, applied before its
    next :meth:`step_done`), so each snapshot holds every earlier correction.

    What a snapshot holds: the thread copies the live replica while the owner
    trains on, and the owner's optimizer step (with Hogwild nets, every net's)
    writes that memory in place meanwhile, so a snapshot may mix the weights of
    two consecutive steps, tensor by tensor and within a tensor (each value as one
    step or the next left it). That is a stale read and nothing more, the staleness
    asynchronous EASGD (and ShadowSync) runs with by design: the thread never
    writes the replica, and the correction is added, on the owner's thread at a
    step boundary, to the replica as it is then, so the steps taken since the
    snapshot are kept (none is lost or overwritten; the correction is as old as
    its snapshot). An exchange moves exactly alpha d from the group to the centre
    whatever the snapshot held, so the sum of the replicas and the centre is kept
    too; the snapshot only decides where the elastic pull points.

    ``wait``: :meth:`wait_idle` lets the step boundary wait for the exchange it
    started, which makes the average synchronous (with ``mode = "sync"`` at the
    centre, deterministic): for checks against a model. The owner then waits at
    the boundary while the thread copies, so each snapshot is exactly the replica
    after that step."""

    def __init__(self, client: EasgdClient, live: np.ndarray, wait: bool = False):
        self.client, self.live, self.wait = client, live, wait
        self._steps = 0           # step_done calls
        self._done = 0            # steps covered by exchanges started
        self._pending: Optional[np.ndarray] = None  # -alpha d not yet taken
        self._busy = False        # an exchange in flight
        self._cv = threading.Condition()
        self._closing = False
        self._drained = False     # the thread has ended (drain)
        self._stopped = False
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=f"hps-easgd-g{client.group}", daemon=True)
        self._thread.start()

    def _due(self) -> bool:
        return self._steps - self._done >= self.client.config.period and self._pending is None

    def step_done(self) -> None:
        with self._cv:
            self._steps += 1
            self._cv.notify_all()
        self._raise()

    def wait_idle(self) -> None:
        """Until no exchange is due or in flight (the synchronous variant's boundary)."""
        with self._cv:
            self._cv.wait_for(lambda: self.error is not None or not (self._busy or self._due()))
        self._raise()

    def state_dict(self) -> dict:
        """For a checkpoint, at a step boundary: waits for the exchange due or in flight
        (so that the centre holds no half of an exchange the checkpoint lacks), then the
        local steps, the steps the exchanges covered and the correction not yet taken.
        After :meth:`drain` the thread has ended (nothing in flight, nothing will start):
        the same, without waiting (the last correction taken, an exchange may be due)."""
        if self._drained:
            self._raise()
        else:
            self.wait_idle()
        with self._cv:
            return {"steps": self._steps, "done": self._done, "exchanges": self.client.exchanges,
                    "pending": None if self._pending is None else self._pending.copy()}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's state_dict, before the first step_done (the next exchange
        falls where it would have; a correction pending then lands at the next step)."""
        pending = state["pending"]
        if pending is not None and (pending.dtype != self.live.dtype or pending.shape != self.live.shape):
            raise ValueError(f"BackgroundEasgd: the checkpoint's correction is {pending.dtype} {pending.shape}, the "
                             f"replica {self.live.dtype} {self.live.shape}")
        with self._cv:
            self._steps, self._done = int(state["steps"]), int(state["done"])
            self._pending = None if pending is None else pending.copy()
            self.client.exchanges = int(state["exchanges"])
            self._cv.notify_all()

    def take(self) -> Optional[np.ndarray]:
        """The correction (add it to the live replica) of the exchange finished since
        the last take, or None. Starts nothing: the next exchange waits for step_done."""
        with self._cv:
            corr, self._pending = self._pending, None
        self._raise()
        return corr

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        period = self.client.config.period
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._closing or self._due())
                    if not self._due():
                        return
                    self._done = self._steps - (self._steps - self._done) % period
                    self._busy = True
                corr = np.zeros_like(self.live)
                self.client.exchange(self.live.copy(), apply_to=corr)
                with self._cv:
                    self._pending, self._busy = corr, False
                    self._cv.notify_all()
        except BaseException as e:  # re-raised in the training thread by step_done / take / close
            with self._cv:
                self.error, self._busy = e, False
                self._cv.notify_all()

    def drain(self) -> None:
        """Lets the thread finish an exchange that is due or in flight, and ends it;
        its correction is left for a last :meth:`take`."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()
        self._drained = True
        self._raise()

    def close(self) -> None:
        """drain(), then tells the centre this group stopped (once)."""
        self.drain()
        if not self._stopped:
            self._stopped = True
            self.client.stop()


class GroupAverage:
    """Lands a group's background EASGD corrections on every copy of its replica at
    one step boundary: the group's trainers each hold a copy of the trainer-held
    layers, a group PS the only copy of its blocks (``comm`` None).

    The root (the copy with the :class:`BackgroundEasgd`) broadcasts over ``comm``,
    at every step boundary, a one-byte flag: whether a correction is ready; only
    then the correction itself. Every copy adds the same float32 array to the same
    replica at the same step, so the copies cannot drift: between boundaries they
    change only by the optimizer's step on all-reduced gradients, which is the same
    on each (same values, same order). The cost when nothing is ready is the flag's
    broadcast, one a step.

    Call :meth:`step` on every copy after each optimizer step, and :meth:`finish`
    after the last (the in-flight exchange's correction lands everywhere too).

    ``timeout``: seconds a broadcast waits for the root (None: for ever); past it,
    BroadcastTimeout names the correction's broadcast and ``ranks`` (the ranks of
    `comm` as the job numbers them), and the caller ends the job."""

    def __init__(self, live: np.ndarray, background: Optional[BackgroundEasgd], comm=None, root: int = 0, *,
                 timeout: Optional[float] = None, ranks: Optional[Sequence[int]] = None):
        self.live, self.background, self.comm, self.root = live, background, comm, root
        self.timeout, self.ranks = timeout, ranks
        self.corrections = 0      # corrections applied, the same on every copy
        self.finished = False
        self._flag = np.zeros(1, np.int8)
        is_root = comm is None or comm.Get_rank() == root
        if is_root != (background is not None):
            raise ValueError("GroupAverage: the root, and only it, runs the background exchange")

    def _land(self, corr: Optional[np.ndarray]) -> None:
        if self.comm is not None and self.comm.Get_size() > 1:
            self._flag[0] = corr is not None
            bcast_within(self.comm, self._flag, self.root, self.timeout,
                         "whether an average's correction is ready", self.ranks)
            if not self._flag[0]:
                return
            if corr is None:
                corr = np.empty_like(self.live)
            bcast_within(self.comm, corr, self.root, self.timeout, "an average's correction", self.ranks)
        elif corr is None:
            return
        self.live += corr
        self.corrections += 1

    def step(self) -> None:
        bg = self.background
        if bg is not None and bg.wait:  # synchronous: this step's exchange lands at this boundary
            bg.step_done()
            bg.wait_idle()
            self._land(bg.take())
            return
        # Taken and applied before step_done: the next snapshot holds this correction.
        self._land(bg.take() if bg is not None else None)
        if bg is not None:
            bg.step_done()

    def state_dict(self) -> dict:
        """For a checkpoint, at a step boundary, on every copy (the root's holds its
        background exchange's; after :meth:`finish` too: a finished run resumed to
        train further counts on from its exchanges, in the period's phase)."""
        return {"corrections": self.corrections,
                "background": None if self.background is None else self.background.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.corrections = int(state["corrections"])
        if self.background is not None and state.get("background") is not None:
            self.background.load_state_dict(state["background"])

    def finish(self) -> None:
        """After the last step, on every copy (again: a no-op)."""
        if self.finished:
            return
        self.finished = True
        if self.background is not None:
            self.background.drain()
        self._land(self.background.take() if self.background is not None else None)
        if self.background is not None:
            self.background.close()


class AllreduceAverage:
    """Synchronous model averaging across groups: every `period` calls of
    :meth:`step` (one a local step), ``live`` becomes the mean of the G groups'
    copies of the same part, summed by MPI all-reduce over `comm`, a communicator
    of the ranks that hold that part in each group (trainer t of every group, or
    group PS p of every group), ordered by group.

    Every rank of `comm` gets the same sum (the same values reduced by the same
    algorithm), so the groups' replicas are equal bit for bit after each average;
    a group's trainers, which hold equal copies before, stay equal too. No codec:
    the all-reduce sums float32 in MPI (HierarchicalConfig refuses an ``averaging``
    codec with it). Bytes are counted under ``averaging`` as float32: the replica
    sent and received once each per average (what a ring all-reduce moves per
    rank, 2 (G-1)/G of the replica each way, rounded up).

    :meth:`finish` after the last step averages once more if steps were taken since
    the last average, so the job ends with one model across the groups.

    ``timeout``: seconds an average waits for the other groups (None: for ever);
    past it, AllreduceTimeout names `what` and `ranks` (the ranks of `comm` as the
    job numbers them), and the caller ends the job."""

    background = None  # no background thread (GroupAverage's readers look for one)

    def __init__(self, live: np.ndarray, comm, period: int, counter: Optional[ByteCounter] = None, *,
                 timeout: Optional[float] = None, what: str = "the synchronous average across groups",
                 ranks: Optional[Sequence[int]] = None):
        if not (isinstance(period, int) and not isinstance(period, bool) and period >= 1):
            raise ValueError(f"AllreduceAverage: period must be an int >= 1, got {period!r}")
        if not isinstance(live, np.ndarray) or live.dtype != np.float32 or not live.flags.c_contiguous:
            raise TypeError("AllreduceAverage: live must be a contiguous float32 numpy array (the replica's memory)")
        self.live, self.comm, self.period = live, comm, period
        self.timeout, self.what, self.ranks = timeout, what, ranks
        self.counter = counter or ByteCounter()
        self.groups = comm.Get_size()
        self.steps = 0
        self.corrections = 0      # averages taken (the same on every rank of comm)
        self.finished = False
        self._averaged_at = 0

    def _average(self) -> None:
        if self.live.size:
            # Summed in a copy: the float32 sum of the groups' finite replicas can
            # overflow (and a NaN of one group's spreads to all), and the replicas then
            # stepped from an infinity. Every rank holds the same sum, so every rank
            # refuses it alike, before its replica changes. (A copy of the replica is
            # small beside the all-reduce that moves it.)
            total = self.live.copy()
            allreduce_within(self.comm, total, self.timeout, self.what, self.ranks)
            with np.errstate(over="ignore", invalid="ignore"):  # (refused just below)
                total *= np.float32(1.0 / self.groups)
            refuse_unsendable(total, "none", f"{self.what} (average {self.corrections + 1}, over ranks "
                                             f"{_named(self.comm, self.ranks)}): the mean of the groups' replicas",
                              "finite values of the groups can overflow in their float32 sum; no replica changed")
            self.live[...] = total
            self.counter.add("averaging", 2 * self.live.nbytes, 2 * self.live.nbytes)
        self.corrections += 1
        self._averaged_at = self.steps

    def step(self) -> None:
        self.steps += 1
        if self.steps % self.period == 0:
            self._average()

    def state_dict(self) -> dict:
        """The steps counted (the period's phase), the last averaged one and the averages."""
        return {"steps": self.steps, "averaged_at": self._averaged_at, "corrections": self.corrections}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self._averaged_at = int(state["steps"]), int(state["averaged_at"])
        self.corrections = int(state["corrections"])

    def finish(self) -> None:
        """After the last step, on every rank of comm (again: a no-op)."""
        if self.finished:
            return
        self.finished = True
        if self.steps > self._averaged_at:
            self._average()
