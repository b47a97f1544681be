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
from a :class:`BackgroundEasgd` thread while training goes on.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from hps.errors import HpsError
from hps.hierarchical.codecs import ByteCounter, CodecStreams, decode

__all__ = ["EasgdConfig", "Easgd", "EasgdCentre", "EasgdClient", "BackgroundEasgd", "CentreTimeout"]


@dataclass
class EasgdConfig:
    alpha: float = 0.1        # elasticity: the share of the difference each side moves per exchange
    period: int = 1           # local steps between a group's exchanges (tau)
    mode: str = "async"       # "async": one group at a time (background); "sync": all groups against one centre

    def check(self, source: str = "[hierarchical]") -> None:
        if not (isinstance(self.alpha, (int, float)) and 0.0 < self.alpha <= 1.0):
            raise ValueError(f"{source}: alpha (elasticity) must be in (0, 1], got {self.alpha!r}")
        if not (isinstance(self.period, int) and not isinstance(self.period, bool) and self.period >= 1):
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
        if not (isinstance(groups, int) and groups >= 1):
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
        self.steps[g] += 1
        if self.steps[g] % self.config.period:
            return False
        self.exchange(g, x)
        return True


# ---------------------------------------------------------------- between ranks


class CentreTimeout(HpsError):
    """The centre or a group did not answer an exchange within the timeout."""


def _wait(comm, source: int, tag: int, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not comm.Iprobe(source=source, tag=tag):
        if time.monotonic() > deadline:
            raise CentreTimeout(f"{what}: no answer from rank {source} within {timeout:g} s (it died or hung)")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
    return comm.recv(source=source, tag=tag)


_TAG = 41


class EasgdCentre:
    """The centre on a rank of its own: serves the groups' exchanges until each has
    said stop. ``async``: one group at a time, in the order they arrive; ``sync``:
    a round waits for every group, then answers all from one centre.

    A group sends its replica through the ``averaging`` codec; the centre returns
    d = x - c through it too; the group applies x -= alpha d."""

    def __init__(self, comm, x0: np.ndarray, group_ranks: Sequence[int], config: EasgdConfig,
                 codecs: Optional[CodecStreams] = None, counter: Optional[ByteCounter] = None):
        self.comm = comm
        self.ranks = list(group_ranks)
        self.easgd = Easgd(x0, len(self.ranks), config)
        self.codecs = codecs or CodecStreams()
        self.counter = counter or ByteCounter()

    def serve(self, timeout: float = 600.0) -> np.ndarray:
        """Returns the final centre."""
        from mpi4py import MPI
        live = set(range(len(self.ranks)))
        pending: dict = {}
        status = MPI.Status()
        while live:
            deadline = time.monotonic() + timeout
            while not self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG, status=status):
                if time.monotonic() > deadline:
                    waiting = ", ".join(f"group {g} (rank {self.ranks[g]})" for g in sorted(live - set(pending)))
                    raise CentreTimeout(f"EASGD centre: nothing from {waiting} within {timeout:g} s")
                time.sleep(1e-4)
            src = status.Get_source()
            op, g, enc = self.comm.recv(source=src, tag=_TAG)
            if src != self.ranks[g]:
                raise ValueError(f"EASGD centre: rank {src} spoke as group {g} (rank {self.ranks[g]})")
            if op == "stop":
                live.discard(g)
                self.comm.send(None, dest=src, tag=_TAG)
                continue
            x = decode(enc)
            if self.easgd.config.mode == "async":
                self.comm.send(self._encode(g, self.easgd.difference(g, x)), dest=src, tag=_TAG)
                continue
            pending[g] = x
            if len(pending) == len(live):  # a sync round: every live group has sent
                before = self.easgd.centre.copy()
                for h, xh in sorted(pending.items()):
                    d = xh - before
                    self.easgd.centre += np.float32(self.easgd.config.alpha) * d
                    self.easgd.exchanges += 1
                    self.comm.send(self._encode(h, d), dest=self.ranks[h], tag=_TAG)
                pending.clear()
        return self.easgd.centre

    def _encode(self, g: int, d: np.ndarray):
        return self.counter.encode(self.codecs.get("averaging", ("centre", g)), "averaging", d)


class EasgdClient:
    """A group's side: exchanges its replica (a float32 array, changed in place)
    with the centre."""

    def __init__(self, comm, centre_rank: int, group: int, config: EasgdConfig,
                 codecs: Optional[CodecStreams] = None, counter: Optional[ByteCounter] = None,
                 timeout: float = 600.0):
        config.check()
        self.comm, self.centre, self.group, self.config = comm, centre_rank, group, config
        self.codecs = codecs or CodecStreams()
        self.counter = counter or ByteCounter()
        self.timeout = timeout
        self.exchanges = 0

    def exchange(self, x: np.ndarray, apply_to: Optional[np.ndarray] = None) -> None:
        """Sends x; applies -alpha d to `apply_to` (default x) when the centre answers.
        With a snapshot as x and the live parameters as apply_to, training goes on
        meanwhile (ShadowSync)."""
        enc = self.counter.encode(self.codecs.get("averaging", ("group", self.group)), "averaging", x)
        self.comm.send(("exchange", self.group, enc), dest=self.centre, tag=_TAG)
        d = decode(_wait(self.comm, self.centre, _TAG, self.timeout, f"EASGD exchange of group {self.group}"))
        target = x if apply_to is None else apply_to
        target -= np.float32(self.config.alpha) * d
        self.exchanges += 1

    def stop(self) -> None:
        self.comm.send(("stop", self.group, None), dest=self.centre, tag=_TAG)
        _wait(self.comm, self.centre, _TAG, self.timeout, f"EASGD stop of group {self.group}")


class BackgroundEasgd:
    """ShadowSync's scheme: a thread that, every `period` local steps (counted by
    :meth:`step_done`), snapshots the live replica, exchanges the snapshot with the
    centre and applies -alpha d to the live replica, while training goes on
    (lock-free, as Hogwild). Give it a communicator of its own (``comm.Dup()``):
    its messages must not meet the training's."""

    def __init__(self, client: EasgdClient, live: np.ndarray):
        self.client, self.live = client, live
        self._steps = 0
        self._done = 0
        self._cv = threading.Condition()
        self._closing = False
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=f"hps-easgd-g{client.group}", daemon=True)
        self._thread.start()

    def step_done(self) -> None:
        with self._cv:
            self._steps += 1
            self._cv.notify()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        period = self.client.config.period
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._closing or self._steps - self._done >= period)
                    if self._steps - self._done < period:
                        return
                    self._done = self._steps - (self._steps - self._done) % period
                self.client.exchange(self.live.copy(), apply_to=self.live)
        except BaseException as e:  # re-raised in the training thread by step_done / close
            self.error = e

    def close(self) -> None:
        """Lets the thread finish its exchange, then tells the centre this group stopped."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()
        if self.error is not None:
            raise self.error
        self.client.stop()
