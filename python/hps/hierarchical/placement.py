"""An MLP's placement plan (where each Linear runs: :class:`FcPlacement`,
:class:`SplitPlan`) and its checks against the Linears' widths (:func:`check_plan`).

Without torch, which is an optional extra: a ``[hierarchical]`` config is checked,
and ``hps plan`` plans, where it is not installed. :mod:`hps.hierarchical.split_mlp`
runs a plan on an ``nn.Sequential`` (with torch) and checks it here first.

Linears are named as ``hps plan``'s table names them: ``fc<j>`` for the j-th Linear,
from 0, as the config's ``placement[j]`` places it; an error adds the Linear's
position among the Sequential's modules (``module 2 of the Sequential``: the model's
MLP has a ReLU after each hidden Linear, so fc1 is module 2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

__all__ = ["FcPlacement", "SplitPlan", "WHERE", "SPLITS", "blocks", "check_plan", "linear_name", "mlp_modules"]

WHERE = ("trainer", "ps")
SPLITS = ("none", "vertical", "horizontal")


@dataclass(frozen=True)
class FcPlacement:
    where: str = "trainer"   # "trainer" or "ps"
    split: str = "none"      # on a PS: "none" (one PS holds it), "vertical" (output columns), "horizontal" (input rows)
    ps: int = 0              # split "none" on a PS: the group PS that holds the layer
    pair: bool = False       # co-partitioned with the next Linear (this vertical, the next horizontal)


@dataclass
class SplitPlan:
    fcs: list                # one FcPlacement per nn.Linear, in order
    group_ps: int = 2        # group PSs that share the PS-held layers

    @classmethod
    def all_trainer(cls, seq, group_ps: int = 2) -> "SplitPlan":
        from hps.hierarchical.split_mlp import linear_indices  # (seq is an nn.Sequential: torch is there)
        return cls([FcPlacement() for _ in linear_indices(seq)], group_ps)


def blocks(n: int, parts: int, what: str = "width") -> list:
    """[lo, hi) of `parts` contiguous blocks of n, the first n % parts one longer."""
    if n < parts:
        raise ValueError(f"a {what} of {n} cannot be split over {parts} group PSs (one column each at least)")
    sizes = [n // parts + (i < n % parts) for i in range(parts)]
    ends = np.cumsum([0] + sizes)
    return [(int(ends[i]), int(ends[i + 1])) for i in range(parts)]


def mlp_modules(linears: int) -> list:
    """The positions of the Linears among the modules of the model's MLP
    (hps.torch.mlp: Linear, ReLU, ..., Linear): 0, 2, 4, ..."""
    return [2 * j for j in range(linears)]


def linear_name(j: int, module: int, shape: tuple) -> str:
    """Linear j as errors name it: hps plan's name, its widths, its module."""
    return f"fc{j} ({shape[0]} -> {shape[1]}, module {module} of the Sequential)"


def check_plan(shapes: Sequence[tuple], plan: SplitPlan, modules: Optional[Sequence[int]] = None) -> None:
    """Raises ValueError (TypeError for a plan that is no SplitPlan) unless `plan`
    fits Linears of these (in, out) widths: a split no wider than its layer, a pair
    as the co-partition rule has it. `modules`: the Linears' positions in the
    Sequential, for the errors (default: the model's MLP's, mlp_modules)."""
    if not isinstance(plan, SplitPlan):
        raise TypeError(f"plan must be a SplitPlan, got {type(plan).__name__}")
    if len(plan.fcs) != len(shapes):
        raise ValueError(f"the plan places {len(plan.fcs)} Linear layers, the MLP has {len(shapes)}")
    modules = mlp_modules(len(shapes)) if modules is None else list(modules)
    P = plan.group_ps
    if not (isinstance(P, int) and P >= 1):
        raise ValueError(f"plan: group_ps must be an int >= 1, got {P!r}")
    for j, ((fin, fout), pl) in enumerate(zip(shapes, plan.fcs)):
        name = linear_name(j, modules[j], (fin, fout))
        if pl.where not in WHERE or pl.split not in SPLITS:
            raise ValueError(f"plan: {name}: where must be one of {WHERE} and split one of {SPLITS}, got "
                             f"{pl.where!r}, {pl.split!r}")
        if pl.where == "trainer" and (pl.split != "none" or pl.pair):
            raise ValueError(f"plan: {name} runs on the trainer, so it cannot be split or paired")
        if pl.where == "ps" and pl.split == "none" and not 0 <= pl.ps < P:
            raise ValueError(f"plan: {name}: ps {pl.ps} out of range [0, {P})")
        for split, side, width in (("vertical", "output", fout), ("horizontal", "input", fin)):
            if pl.split == split and width < P:
                raise ValueError(f"plan: {name}: its {side} width of {width} cannot be split over {P} group PSs "
                                 f"(one column each at least)")
        if pl.pair:
            if j + 1 == len(shapes):
                raise ValueError(f"plan: {name} is paired but is the last Linear")
            (in2, out2), npl = shapes[j + 1], plan.fcs[j + 1]
            if pl.split != "vertical" or npl.where != "ps" or npl.split != "horizontal" or npl.pair:
                raise ValueError(f"plan: {name} is paired: it must be split vertically and the next Linear "
                                 f"horizontally (and not paired itself), got {pl.split!r} then {npl.where!r} "
                                 f"{npl.split!r}")
            if not (fout > fin and out2 < in2):
                raise ValueError(f"plan: {name} and fc{j + 1} break the co-partition rule (the first output wider "
                                 f"than its input, the second narrower): {fin} -> {fout} -> {out2}")
