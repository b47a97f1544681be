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
replica: the reference, and what the centre rank runs); :mod:`hps.hierarchical.roles`
runs it between ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["EasgdConfig", "Easgd"]


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
