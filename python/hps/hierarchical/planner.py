"""HT's operator placement (KDD 2021, section 4.2): where each Linear of a group's
dense model runs, in two parts, as the paper does it.

1. Tagging by rules (:func:`tag`): a Linear whose weights reach ``big_fc_bytes``
   goes to the group PSs, split vertically (output columns) when its output is at
   least as wide as its input, horizontally (input rows) otherwise; two such
   Linears in a row that meet the co-partition rule (the first's output wider than
   its input, the second's narrower) become a pair. The rest stays on the trainer.
2. Greedy refinement (:func:`refine`): the modelled step finds its bottleneck node;
   of the moves of one Linear off that node (to the trainer, to the PSs split either
   way or whole on one PS, into or out of a pair, or a whole pair back to the trainer)
   it takes the one that lowers the modelled step most, and repeats until no move
   helps or ``time_limit`` seconds have passed.

The cost model (:func:`costs`), per training step of ``batch_size`` examples on one
trainer and ``group_ps`` PSs:
  CPU     a Linear (in -> out) costs 6 * B * in * out FLOPs (forward 2, backward 4:
          input and weight gradients), on the node(s) holding it, in proportion to
          their blocks; seconds = FLOPs / the node's ``flops``.
  network the tensors each segment sends, forward through the ``activations``
          codec and backward through the ``gradients`` codec, at their bytes per
          value (float32 4, bf16 2, int8 1 plus a 4-byte scale a row, top-k 8 per
          value sent); a node's seconds = (bytes in + bytes out) / its ``bandwidth``.
  memory  the weights held times (1 + ``optimizer_slots``), 4 bytes a value.
  A node's time is max(CPU, network) (the two overlap); the step's is the slowest
  node's. A plan that needs more memory than a node has is refused (PlanError
  naming the node, what it needs and what it has).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Optional

from hps.errors import HpsError
# (Not split_mlp, which imports torch: hps plan, and a config's check, need none.)
from hps.hierarchical.placement import FcPlacement, SplitPlan, check_plan

__all__ = ["PlannerConfig", "NodeCost", "PlanResult", "PlanError", "tag", "costs", "node_costs", "refine", "plan",
           "format_plan", "linear_shapes", "load_plan_config", "plan_of_config"]


class PlanError(HpsError):
    """No placement fits the nodes' memory."""


@dataclass
class PlannerConfig:
    batch_size: int = 4096
    group_ps: int = 2                       # group PSs per group
    trainer_flops: float = 100e9            # FLOP/s a trainer sustains on dense layers
    ps_flops: float = 100e9                 # FLOP/s a group PS sustains
    bandwidth: float = 1.25e9               # bytes/s of each node's network link (10 Gb/s)
    trainer_memory: float = 16e9            # bytes for dense weights and their optimizer state on a trainer
    ps_memory: float = 16e9                 # the same on a group PS
    optimizer_slots: int = 1                # optimizer state values per weight (Adam: 2, AdaGrad: 1, SGD: 0)
    big_fc_bytes: float = 4e6               # tagging rule: a Linear with this many weight bytes goes to the PSs
    activations: str = "none"               # codec of forward traffic (none, bf16, int8, topk:RATIO)
    gradients: str = "none"                 # codec of backward traffic
    time_limit: float = 1.0                 # seconds of greedy refinement at most

    def check(self, source: str = "[hierarchical]") -> None:
        from hps.config import is_int, is_number
        from hps.hierarchical.codecs import make_codec
        for name in ("batch_size", "group_ps"):
            v = getattr(self, name)
            if not (is_int(v) and v >= 1):
                raise ValueError(f"{source}: {name} must be an int >= 1, got {v!r}")
        for name in ("trainer_flops", "ps_flops", "bandwidth", "trainer_memory", "ps_memory"):
            v = getattr(self, name)
            if not (is_number(v) and v > 0):
                raise ValueError(f"{source}: {name} must be > 0, got {v!r}")
        if not (is_int(self.optimizer_slots) and self.optimizer_slots >= 0):
            raise ValueError(f"{source}: optimizer_slots must be an int >= 0, got {self.optimizer_slots!r}")
        if not (is_number(self.time_limit) and self.time_limit >= 0):  # (a string failed the comparison)
            raise ValueError(f"{source}: time_limit must be >= 0 seconds, got {self.time_limit!r}")
        for name in ("activations", "gradients"):
            try:
                make_codec(getattr(self, name))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{source}: {name}: {e}") from None


@dataclass
class NodeCost:
    name: str                 # "trainer" or "ps<i>"
    flops: float = 0.0
    net_bytes: float = 0.0
    memory: float = 0.0
    cpu_s: float = 0.0
    net_s: float = 0.0
    layers: list = field(default_factory=list)

    @property
    def time_s(self) -> float:
        return max(self.cpu_s, self.net_s)


@dataclass
class PlanResult:
    plan: SplitPlan
    nodes: list               # NodeCost per node: the trainer, then each group PS
    step_s: float             # the modelled step: the slowest node's time
    bottleneck: str
    moves: int = 0            # refinement moves taken
    shapes: list = field(default_factory=list)
    given: str = ""           # not the planner's: where the config fixes the placement (plan_of_config)
    timed_out: bool = False   # the refinement stopped at time_limit (a move might still have helped)


def linear_shapes(seq) -> list:
    from hps.hierarchical.split_mlp import linear_indices
    return [(seq[i].in_features, seq[i].out_features) for i in linear_indices(seq)]


def _bytes_per_value(codec: str, width: int) -> float:
    name, _, arg = codec.partition(":")
    if name == "bf16":
        return 2.0
    if name == "int8":
        return 1.0 + 4.0 / max(1, width)
    if name == "topk":
        return 8.0 * float(arg)
    return 4.0


def tag(shapes: list, cfg: PlannerConfig) -> SplitPlan:
    """The rule-based plan (part 1)."""
    P = cfg.group_ps
    fcs = []
    for fin, fout in shapes:
        big = 4.0 * fin * fout >= cfg.big_fc_bytes
        if big and fout >= fin and fout >= P:
            fcs.append(FcPlacement("ps", "vertical"))
        elif big and fin >= P:
            fcs.append(FcPlacement("ps", "horizontal"))
        else:
            fcs.append(FcPlacement())
    j = 0
    while j + 1 < len(fcs):
        (a_in, a_out), (b_in, b_out) = shapes[j], shapes[j + 1]
        if fcs[j].where == fcs[j + 1].where == "ps" and a_out > a_in and b_out < b_in:
            fcs[j] = FcPlacement("ps", "vertical", pair=True)
            fcs[j + 1] = FcPlacement("ps", "horizontal")
            j += 2
        else:
            j += 1
    return SplitPlan(fcs, P)


def costs(shapes: list, plan: SplitPlan, cfg: PlannerConfig) -> list:
    """The modelled CPU, network and memory of each node under `plan` (one step)."""
    P = plan.group_ps
    B = cfg.batch_size
    nodes = [NodeCost("trainer")] + [NodeCost(f"ps{p}") for p in range(P)]
    trainer, ps = nodes[0], nodes[1:]
    slots = 4.0 * (1 + cfg.optimizer_slots)

    def act(width):
        return B * width * _bytes_per_value(cfg.activations, width)

    def grad(width):
        return B * width * _bytes_per_value(cfg.gradients, width)

    def traffic(p, sent_fwd, got_fwd, sent_bwd, got_bwd):
        """Trainer <-> PS p: widths the trainer sends / gets forward, sends / gets backward."""
        b = act(sent_fwd) + act(got_fwd) + grad(sent_bwd) + grad(got_bwd)
        trainer.net_bytes += b
        ps[p].net_bytes += b

    j = 0
    while j < len(shapes):
        fin, fout = shapes[j]
        pl = plan.fcs[j]
        if pl.where == "trainer":
            trainer.flops += 6.0 * B * fin * fout
            trainer.memory += slots * (fin * fout + fout)
            trainer.layers.append(f"fc{j}")
            j += 1
            continue
        if pl.pair:
            mid, (_, out2) = fout, shapes[j + 1]
            for p in range(P):
                n = _block(mid, P, p)
                ps[p].flops += 6.0 * B * (fin * n + n * out2)
                ps[p].memory += slots * (fin * n + n + n * out2 + (out2 if p == 0 else 0))
                ps[p].layers.append(f"fc{j}+fc{j + 1}")
                traffic(p, fin, out2, out2, fin)
            j += 2
            continue
        if pl.split == "none":
            q = ps[pl.ps]
            q.flops += 6.0 * B * fin * fout
            q.memory += slots * (fin * fout + fout)
            q.layers.append(f"fc{j}")
            traffic(pl.ps, fin, fout, fout, fin)
        elif pl.split == "vertical":
            for p in range(P):
                n = _block(fout, P, p)
                ps[p].flops += 6.0 * B * fin * n
                ps[p].memory += slots * (fin * n + n)
                ps[p].layers.append(f"fc{j}")
                traffic(p, fin, n, n, fin)
        else:
            for p in range(P):
                n = _block(fin, P, p)
                ps[p].flops += 6.0 * B * n * fout
                ps[p].memory += slots * (n * fout + (fout if p == 0 else 0))
                ps[p].layers.append(f"fc{j}")
                traffic(p, n, fout, fout, n)
        j += 1
    trainer.cpu_s = trainer.flops / cfg.trainer_flops
    for n in ps:
        n.cpu_s = n.flops / cfg.ps_flops
    for n in nodes:
        n.net_s = n.net_bytes / cfg.bandwidth
    return nodes


def node_costs(shapes: list, plan: SplitPlan, cfg: PlannerConfig) -> list:
    """The modelled step of a given plan (one the planner made, or one a config names),
    per node as plain numbers, for a benchmark to set beside what it measures:
    ``[{"node", "layers", "flops", "cpu_s", "net_bytes", "net_s", "memory", "time_s"}]``,
    the trainer first, then each group PS. ``cpu_s`` is ``flops`` at the node's
    ``trainer_flops`` / ``ps_flops``, ``net_s`` ``net_bytes`` at ``bandwidth``.

    Raises ValueError for a bad config, a plan of another length than ``shapes`` or
    one the split MLP would refuse (a pair whose shapes break the rule, a split wider
    than its layer)."""
    cfg.check()
    if len(plan.fcs) != len(shapes):
        raise ValueError(f"node_costs: the plan places {len(plan.fcs)} Linear layers, the shapes have "
                         f"{len(shapes)}")
    check_plan(shapes, plan)  # the split MLP's own checks, with its message
    return [{"node": n.name, "layers": list(n.layers), "flops": n.flops, "cpu_s": n.cpu_s,
             "net_bytes": n.net_bytes, "net_s": n.net_s, "memory": n.memory, "time_s": n.time_s}
            for n in costs(shapes, plan, cfg)]


def _block(n: int, parts: int, p: int) -> int:
    return n // parts + (p < n % parts)


def _over_memory(nodes: list, cfg: PlannerConfig) -> float:
    return sum(max(0.0, n.memory - (cfg.trainer_memory if n.name == "trainer" else cfg.ps_memory)) for n in nodes)


def _score(shapes, plan, cfg):
    nodes = costs(shapes, plan, cfg)
    worst = max(nodes, key=lambda n: n.time_s)
    return (_over_memory(nodes, cfg), worst.time_s), nodes, worst


def _valid(shapes: list, plan: SplitPlan, seen: Optional[dict] = None) -> bool:
    """Whether `plan` passes the split MLP's checks (placement.check_plan) for these shapes.
    ``seen``: the answers so far for these shapes (one refinement meets a plan many
    times), kept by the caller for its own search: a cache here for the process
    grew with every plan made in it."""
    key = (plan.group_ps, tuple(plan.fcs))
    hit = seen.get(key) if seen is not None else None
    if hit is None:
        try:
            check_plan(shapes, plan)
            hit = True
        except ValueError:
            hit = False
        if seen is not None:
            seen[key] = hit
    return hit


def _moves(plan: SplitPlan, j: int) -> list:
    """Plans that differ from `plan` in Linear j's placement (pairs through j broken
    or made)."""
    P = plan.group_ps
    fcs = list(plan.fcs)
    if j > 0 and fcs[j - 1].pair:
        fcs[j - 1] = replace(fcs[j - 1], pair=False)
    options = [FcPlacement(), FcPlacement("ps", "vertical"), FcPlacement("ps", "horizontal")]
    options += [FcPlacement("ps", "none", ps=q) for q in range(P)]
    out = []
    for o in options:
        if o != plan.fcs[j] or fcs != list(plan.fcs):
            new = list(fcs)
            new[j] = o
            out.append(SplitPlan(new, P))
    # A co-partitioned pair is one operator too: both halves back to the trainer at once
    # (one at a time, each half's move alone may send the wide intermediate over the network).
    first = j if plan.fcs[j].pair else j - 1 if j > 0 and plan.fcs[j - 1].pair else None
    if first is not None:
        new = list(plan.fcs)
        new[first] = new[first + 1] = FcPlacement()
        out.append(SplitPlan(new, P))
    if j + 1 < len(fcs) and not plan.fcs[j].pair:
        new = list(fcs)
        new[j] = FcPlacement("ps", "vertical", pair=True)
        new[j + 1] = FcPlacement("ps", "horizontal")
        out.append(SplitPlan(new, P))
    if j > 0 and not plan.fcs[j - 1].pair:
        new = list(fcs)
        new[j - 1] = FcPlacement("ps", "vertical", pair=True)
        new[j] = FcPlacement("ps", "horizontal")
        out.append(SplitPlan(new, P))
    return out


def refine(shapes: list, start: SplitPlan, cfg: PlannerConfig) -> PlanResult:
    """Greedy refinement (part 2) from `start`; never returns a worse plan."""
    deadline = time.monotonic() + cfg.time_limit
    seen: dict = {}  # _valid's answers for these shapes, for this refinement only
    plan = start
    score, nodes, worst = _score(shapes, plan, cfg)
    moves = 0
    timed_out = False
    while True:
        if time.monotonic() >= deadline:
            timed_out = True
            break
        # Operators that load the bottleneck node (or, while a node is over its memory,
        # that one). Every Linear loads the trainer: its own run there, and a PS-held
        # one's tensors pass through its link.
        over = [n for n in nodes if n.memory > (cfg.trainer_memory if n.name == "trainer" else cfg.ps_memory)]
        target = over[0] if over else worst
        on_target = [j for j, pl in enumerate(plan.fcs)
                     if target.name == "trainer"
                     or (pl.where == "ps" and (pl.split != "none" or f"ps{pl.ps}" == target.name))]
        best = None
        for j in on_target:
            for cand in _moves(plan, j):
                if not _valid(shapes, cand, seen):
                    continue
                s, n2, w2 = _score(shapes, cand, cfg)
                if s < score and (best is None or s < best[0]):
                    best = (s, cand, n2, w2)
        if best is None or not (best[0][0] < score[0] or best[0][1] < score[1] * (1 - 1e-9)):
            break
        score, plan, nodes, worst = best
        moves += 1
    return PlanResult(plan, nodes, worst.time_s, worst.name, moves, list(shapes), timed_out=timed_out)


def plan(shapes: list, cfg: PlannerConfig) -> PlanResult:
    """Tags by rules, refines greedily, and refuses a plan that does not fit."""
    cfg.check()
    if not shapes:
        raise ValueError("plan: the model has no Linear layer")
    start = tag(shapes, cfg)
    if not _valid(shapes, start):  # a rule pair or split the shapes do not allow: start from the trainer
        start = SplitPlan([FcPlacement() for _ in shapes], cfg.group_ps)
    result = refine(shapes, start, cfg)
    for n in result.nodes:
        cap = cfg.trainer_memory if n.name == "trainer" else cfg.ps_memory
        if n.memory > cap:
            # (Cut short by the time limit, the search may not have reached a plan that fits.)
            head, advice = (f"no placement found that fits within [hierarchical.planner] time_limit = "
                            f"{cfg.time_limit:g} s of refinement ({result.moves} moves)", "raise time_limit, ")
            if not result.timed_out:
                head, advice = "no placement fits", ""
            raise PlanError(f"{head}: {_node_label(n.name)} needs {n.memory / 1e6:,.1f} MB for the "
                            f"weights and optimizer state of {', '.join(n.layers)} but has "
                            f"{cap / 1e6:,.1f} MB ({'trainer_memory' if n.name == 'trainer' else 'ps_memory'}); "
                            f"{advice}add group PSs or memory, or use smaller layers")
    return result


def _node_label(name: str) -> str:
    return "the trainer" if name == "trainer" else f"group PS {name[2:]}"


def format_plan(result: PlanResult) -> str:
    """The plan as text: each Linear's place and split, then each node's modelled
    CPU, network and memory."""
    lines = ["layer  shape             runs on          split"]
    fcs = result.plan.fcs
    for j, ((fin, fout), pl) in enumerate(zip(result.shapes, fcs)):
        if pl.where == "trainer":
            where, split = "trainer", "-"
        elif pl.split == "none":
            where, split = f"group PS {pl.ps}", "whole"
        else:
            where = f"group PS 0..{result.plan.group_ps - 1}" if result.plan.group_ps > 1 else "group PS 0"
            split = pl.split
            if pl.pair:
                split += f", co-partitioned with fc{j + 1}"
            elif j > 0 and fcs[j - 1].pair:
                split += f", co-partitioned with fc{j - 1}"
        lines.append(f"fc{j:<4} {fin:>6} -> {fout:<6}  {where:<16} {split}")
    lines.append("")
    lines.append("node      CPU (GFLOP, ms)     network (MB, ms)    memory (MB)  layers")
    for n in result.nodes:
        lines.append(f"{n.name:<9} {n.flops / 1e9:>8.3f} {n.cpu_s * 1e3:>9.3f}  {n.net_bytes / 1e6:>8.3f} "
                     f"{n.net_s * 1e3:>9.3f}  {n.memory / 1e6:>11.3f}  {', '.join(n.layers) or '-'}")
    how = result.given or f"{result.moves} refinement move(s) after the rules"
    lines.append(f"modelled step {result.step_s * 1e3:.3f} ms, bound by {_node_label(result.bottleneck)}; {how}")
    return "\n".join(lines)


def plan_of_config(path) -> PlanResult:
    """The placement a training run of the config at path uses (hps.hierarchical.roles'
    _plan_for), with its modelled costs: every Linear on the trainer when
    ``[hierarchical] group_ps`` is 0 (or there is no such table), the config's own
    ``placement`` when it gives one, else the planner's (:func:`plan`)."""
    import os
    from hps.config import load_toml
    from hps.hierarchical.roles import HierarchicalConfig, parse_placement
    source = os.fspath(path)
    shapes, cfg = load_plan_config(path)
    ht = HierarchicalConfig.from_dict(dict(load_toml(path).get("hierarchical", {})), f"{source}: [hierarchical]")
    if ht.group_ps == 0:
        fixed = SplitPlan([FcPlacement() for _ in shapes], 1)
        given = "group_ps = 0: every layer on the trainer"
    elif ht.placement:
        where = f"{source}: [hierarchical] placement"
        if len(ht.placement) != len(shapes):
            raise ValueError(f"{where} names {len(ht.placement)} Linear layers, the MLP has {len(shapes)}")
        fixed = SplitPlan([parse_placement(s, f"{where}[{j}]") for j, s in enumerate(ht.placement)], ht.group_ps)
        try:  # the split MLP's own checks, as the run makes them (on the model's MLP: fc<j> is module 2j)
            check_plan(shapes, fixed)
        except ValueError as e:
            raise ValueError(f"{where} {list(ht.placement)!r} does not fit the MLP: {e}") from None
        given = "the config's placement, not the planner's"
    else:
        return plan(shapes, cfg)
    nodes = costs(shapes, fixed, cfg)
    if ht.group_ps == 0:
        nodes = nodes[:1]  # no group PS to show
    worst = max(nodes, key=lambda n: n.time_s)
    return PlanResult(fixed, nodes, worst.time_s, worst.name, 0, list(shapes), given)


def load_plan_config(path) -> tuple:
    """(shapes, PlannerConfig) from a training config: the MLP of its ``hidden`` widths
    over the CtrModel's input (``[hierarchical.planner] input_width``, by default the
    Criteo layout's 26 fields of ``[ps] dim`` plus 13 dense features), the batch size
    of ``[data]`` (unless the planner table gives one), ``group_ps`` and the codecs of
    ``[hierarchical]``, the cost model's fields in ``[hierarchical.planner]``."""
    import os
    from hps.config import is_int, load_toml
    from hps.hierarchical.roles import HierarchicalConfig
    source = os.fspath(path)
    d = load_toml(path)
    table = d.get("hierarchical", {})
    if not isinstance(table, dict):
        raise ValueError(f"{source}: hierarchical must be a table")
    for name in ("ps", "data"):  # (`ps = 3`: not a table, read below as one)
        if not isinstance(d.get(name, {}), dict):
            raise ValueError(f"{source}: {name} must be a table, got {d[name]!r}")
    ht = HierarchicalConfig.from_dict(dict(table), f"{source}: [hierarchical]")
    planner = dict(ht.planner)
    ps = d.get("ps", {})
    if "input_width" in planner:
        width = planner.pop("input_width")  # (checked by from_dict)
    else:
        if "dim" not in ps:
            raise ValueError(f"{source}: [ps] dim (or [hierarchical.planner] input_width) is needed for the MLP's "
                             f"input")
        if not (is_int(ps["dim"]) and ps["dim"] >= 1):
            raise ValueError(f"{source}: [ps] dim must be an int >= 1, got {ps['dim']!r}")
        width = 26 * ps["dim"] + 13
    # Checked as hps train checks them (int() took 32.7 for 32, true for 1 and a string
    # or a bare number with an unnamed error).
    hidden = d.get("hidden", [512, 256])
    if not (isinstance(hidden, list) and all(is_int(h) and h >= 1 for h in hidden)):
        raise ValueError(f"{source}: hidden must be a list of layer widths, ints >= 1 ([] for none), got {hidden!r}")
    widths = [width] + hidden + [1]
    if "batch_size" not in planner and "batch_size" in d.get("data", {}):
        batch = d["data"]["batch_size"]
        if not (is_int(batch) and batch >= 1):
            raise ValueError(f"{source}: [data] batch_size must be an int >= 1, got {batch!r}")
        planner["batch_size"] = batch
    ht.planner = planner
    cfg = ht.planner_config()
    cfg.check(f"{source}: [hierarchical.planner]")
    return list(zip(widths[:-1], widths[1:])), cfg
