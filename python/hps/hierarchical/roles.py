"""Hierarchical Training's roles in an MPI job, and `hps train` with them.

The world's ranks, in order: G groups, each of T trainer ranks then P group-PS
ranks, then (G > 1, ``across = "easgd"``) one centre rank for the background
elastic average:

    world = G * (T + P) + (1 if G > 1 and across == "easgd" else 0)

T is what the world size leaves. The centre has a rank of its own rather than
being sharded over the group PSs: one rank answers every group's exchange for every
part of the dense model (the trainer-held layers and each group PS's blocks), one
thread a part, each on a communicator of its own.

Inside a group there is one dense replica: the trainers hold the layers the plan
leaves them (their gradients all-reduced over the group's trainers each step), the
group PSs hold the rest (each trainer's backward adds to the PSs' gradients; a PS
steps once every trainer of its group has asked, so T trainers take one step on the
sum, as the all-reduce does). Sparse embeddings stay as hps.distributed has them:
rows owned by the trainer ranks of every group, bulk-synchronous per batch.

Across groups (G > 1) the replicas are averaged with the centre by EASGD from
background threads (ShadowSync): trainer 0 of each group for the trainer-held part,
each group PS for its blocks; training never waits for them. A thread only fetches
the correction -alpha d; it lands at a step boundary (hps.hierarchical.easgd.
GroupAverage): on a group PS after the step its group's T trainers asked for, on the
trainers after the optimizer step, broadcast by trainer 0 to the group's other
trainers (a one-byte flag a step, the correction only when one is ready), so that
every trainer of a group holds the same replica at every step.

``across = "allreduce"`` averages the groups synchronously instead (hps.hierarchical.
easgd.AllreduceAverage): no centre rank; every ``period`` steps trainer t of each
group all-reduces its copy of the trainer-held part with trainer t of the other
groups (so all of a group's trainers stay equal), and group PS p of each group its
blocks with group PS p of the others, each replaced by the mean over the G groups;
training waits for it. ``alpha`` does not apply and the ``averaging`` codec must be
"none" (MPI sums float32).

Hogwild nets (``nets = R > 1``, hps.hierarchical.hogwild): each trainer cuts its
part of every batch into R slices and R threads train them at once, each net with
its own optimizer stepping, without locks, on the one flat copy of the
trainer-held layers (the replicas' parameters are tensors over that memory). With
T > 1 trainers, net r all-reduces its gradients with net r of the group's other
trainers (a communicator a net), and after the batch trainer 0's copy is broadcast
to the group, so that the group is one replica again at every step boundary, where
the averaging across groups lands. Layers on group PSs are not Hogwild: each net
reaches the PSs through its own MPI tag, the PS serves them one request at a time
and steps once a batch on the sum of every net's gradients, as with one net. The
embedding gradients of the R slices are pushed once a batch (sparse stays BSP).
R = 1 keeps hps.train.Trainer.step untouched.

Checkpoints: at each checkpoint of hps.train (the same step on every trainer), every
trainer rank writes the layout and plan (HT_LAYOUT) beside its dense state, a group's
first trainer its group PSs' state (each PS's blocks, their optimizer, its steps and
its averaging's state, fetched from the PS: HT_GROUP_PS) and trainer rank 0 the
EASGD centre's parts (HT_CENTRE), all in the checkpoint's directory before hps.train
names it. A background exchange in flight is waited for first, and the centre is
asked only once every group has, so no half of an exchange is kept. --resume loads
each role from the checkpoint the job resumes from (the PSs' and the centre's state
sent by the trainers that hold it); a checkpoint lacking a file, another layout or
placement, or another number of trainer ranks (no reshard) is refused.

Limits of this version (issue 18): with R > 1
every net keeps its own Adam state (R times the trainer-held layers' optimizer
memory), and a net's step is on its slice's gradient only (the loss still
normalised by the global batch's examples), so a batch takes R smaller steps; the
group-PS-held layers stay synchronous per batch under Hogwild (above); and each
group's loss is normalised by the examples of all groups' batches (as the sparse
exchange aligns them), which scales the gradients by 1/G (Adam is nearly
indifferent to it).
"""
from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

import numpy as np

from hps.config import is_int, is_number
from hps.distributed import poll
from hps.hierarchical.easgd import (AllreduceAverage, BackgroundEasgd, EasgdCentre, EasgdClient, EasgdConfig,
                                    GroupAverage, allreduce_within, bcast_within, centre_state,
                                    check_averaging_codec, release_centre)

__all__ = ["HierarchicalConfig", "Roles", "parse_placement", "placement_name", "train_hierarchical", "ACROSS"]

ACROSS = ("easgd", "allreduce")  # [hierarchical] across: how the groups' replicas meet
HOGWILD_TAG = 1000  # + r: Hogwild net r's requests to the group PSs and their replies (the trainer's own: tag 1)


@dataclass
class HierarchicalConfig:
    groups: int = 1                  # G: groups, each one dense replica
    group_ps: int = 0                # P: group-PS ranks per group (0: the whole MLP on the trainers)
    nets: int = 1                    # R: Hogwild nets (threads) a trainer on one dense copy; 1: synchronous
    alpha: float = 0.1               # EASGD elasticity across groups
    period: int = 1                  # local steps between a group's exchanges with the centre (or all-reduces)
    across: str = "easgd"            # across groups: "easgd" (background, with a centre) or "allreduce" (synchronous)
    activations: str = "none"        # codec of forward traffic trainer <-> group PS
    gradients: str = "none"          # codec of backward traffic
    averaging: str = "none"          # codec of the exchanges with the centre
    placement: list = field(default_factory=list)  # per Linear: "trainer", "ps:vertical", "ps:vertical:pair",
                                                   # "ps:horizontal", "ps:whole:Q"; empty: the planner's
    planner: dict = field(default_factory=dict)    # PlannerConfig fields for the planner's cost model
    timeout: float = 60.0            # seconds a rank waits for a group PS, the centre or a group's all-reduce
                                     # (for the group PSs' last average, which may wait on the centre twice:
                                     # 3 x, FINISH_WAITS)

    @classmethod
    def from_dict(cls, d: dict, source: str = "[hierarchical]") -> "HierarchicalConfig":
        from hps.config import check_fields
        if not isinstance(d, dict):  # (`hierarchical = 3` in the TOML: not a table)
            raise ValueError(f"{source}: must be a table of fields (groups, group_ps, ...), got {d!r}")
        check_fields(cls, d, source, prefix="hierarchical.")
        cfg = cls(**d)
        cfg.check(source)
        return cfg

    def check(self, source: str = "[hierarchical]") -> None:
        from hps.hierarchical.codecs import make_codec
        from hps.hierarchical.planner import PlannerConfig
        for name in ("groups", "nets"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"{source}: {name} must be an int >= 1, got {v!r}")
        if not (is_int(self.group_ps) and self.group_ps >= 0):
            raise ValueError(f"{source}: group_ps must be an int >= 0, got {self.group_ps!r}")
        EasgdConfig(self.alpha, self.period).check(source)
        if self.across not in ACROSS:
            raise ValueError(f"{source}: across must be one of {', '.join(repr(a) for a in ACROSS)}, got "
                             f"{self.across!r}")
        if self.across == "allreduce" and self.averaging != "none":
            raise ValueError(f"{source}: across = 'allreduce' sums the replicas in MPI as float32; averaging = "
                             f"{self.averaging!r} compresses the EASGD exchanges only: set averaging = 'none' or "
                             f"across = 'easgd'")
        for name in ("activations", "gradients", "averaging"):
            try:
                make_codec(getattr(self, name))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{source}: {name}: {e}") from None
        try:
            check_averaging_codec(self.averaging)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        if not isinstance(self.placement, (list, tuple)):  # (a string would be read a letter a layer)
            raise ValueError(f"{source}: placement must be a list, one place a Linear layer (e.g. "
                             f"[\"ps:vertical\", \"trainer\"]; [] for the planner's), got {self.placement!r}")
        places = [parse_placement(s, f"{source}: placement[{j}]") for j, s in enumerate(self.placement)]
        for j, (s, place) in enumerate(zip(self.placement, places)):
            # (What the widths decide is checked with the MLP: _plan_for.)
            if place.pair and (j + 1 == len(places) or places[j + 1] != parse_placement("ps:horizontal")):
                got = "nothing (it is the last)" if j + 1 == len(places) else repr(self.placement[j + 1])
                raise ValueError(f"{source}: placement[{j}] = {s!r} pairs its layer with the next one, which must be "
                                 f"'ps:horizontal' (the pair's second half), got {got}")
            # (A run with group_ps = 0 keeps every layer on the trainer: a placement on
            # a group PS would be ignored without a word.)
            if place.where == "ps" and self.group_ps == 0:
                raise ValueError(f"{source}: placement[{j}] = {s!r} puts a layer on a group PS, but group_ps = 0 "
                                 f"(no group PS): set group_ps, or place it on the 'trainer'")
            if place.where == "ps" and place.split == "none" and not place.ps < self.group_ps:
                raise ValueError(f"{source}: placement[{j}] = {s!r}: there is no group PS {place.ps} with group_ps = "
                                 f"{self.group_ps} (PSs 0..{self.group_ps - 1})")
        if not isinstance(self.planner, dict):
            raise ValueError(f"{source}: planner must be a table ([hierarchical.planner] of the cost model's "
                             f"fields), got {self.planner!r}")
        known = ({f.name for f in fields(PlannerConfig)} - {"group_ps", "activations", "gradients"}) | {"input_width"}
        unknown = sorted(set(self.planner) - known)
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {', '.join('planner.' + u for u in unknown)}; known: "
                             f"{', '.join('planner.' + k for k in sorted(known))}")
        # Checked with the config: the run plans only on trainer 0, once its data and
        # parameter server are open (and with a placement given, never).
        planner_source = (source[:-1] + ".planner]" if source.endswith("[hierarchical]")
                          else f"{source}: [hierarchical.planner]")
        width = self.planner.get("input_width", 1)
        if not (is_int(width) and width >= 1):
            raise ValueError(f"{planner_source}: input_width must be an int >= 1, got {width!r}")
        self.planner_config().check(planner_source)
        if not (is_number(self.timeout) and self.timeout > 0):
            raise ValueError(f"{source}: timeout must be > 0 seconds, got {self.timeout!r}")

    def planner_config(self):
        from hps.hierarchical.planner import PlannerConfig
        fields_ = {k: v for k, v in self.planner.items() if k != "input_width"}  # hps plan's, not the model's
        return PlannerConfig(**fields_, group_ps=max(1, self.group_ps), activations=self.activations,
                             gradients=self.gradients)


def parse_placement(s: str, where: str = "placement"):
    """One Linear's place from its config string."""
    from hps.hierarchical.placement import FcPlacement  # (no torch: the config is checked without it)
    if not isinstance(s, str):
        raise ValueError(f"{where}: expected a string like 'ps:vertical', got {s!r}")
    parts = s.split(":")
    if parts == ["trainer"]:
        return FcPlacement()
    if parts[:1] == ["ps"] and len(parts) >= 2:
        if parts[1] in ("vertical", "horizontal") and len(parts) == 2:
            return FcPlacement("ps", parts[1])
        if parts[1] == "vertical" and parts[2:] == ["pair"]:
            return FcPlacement("ps", "vertical", pair=True)
        if parts[1] == "whole" and len(parts) == 3 and parts[2].isdigit():
            return FcPlacement("ps", "none", ps=int(parts[2]))
    raise ValueError(f"{where}: cannot read {s!r}; write 'trainer', 'ps:vertical', 'ps:vertical:pair', "
                     f"'ps:horizontal' or 'ps:whole:Q'")


def placement_name(p) -> str:
    """One Linear's place as the config writes it (parse_placement's inverse): "trainer",
    "ps:vertical", "ps:vertical:pair", "ps:horizontal" or "ps:whole:Q". The summary and
    the errors name a plan so: where/split ("ps:none") named no placement, nor the PS."""
    if p.where == "trainer":
        return "trainer"
    if p.split == "none":
        return f"ps:whole:{p.ps}"
    return f"ps:{p.split}{':pair' if p.pair else ''}"


@dataclass
class Roles:
    """Where this rank sits: role "trainer", "group_ps" or "centre"; its group and
    its index among the group's trainers or PSs."""
    world: int
    groups: int
    trainers: int            # T per group
    group_ps: int            # P per group
    rank: int
    role: str
    group: int = -1
    index: int = -1
    across: str = "easgd"    # HierarchicalConfig.across (G > 1: a centre rank with "easgd" only)
    period: int = 1
    nets: int = 1            # R: Hogwild nets a trainer

    @classmethod
    def layout(cls, world: int, rank: int, cfg: HierarchicalConfig) -> "Roles":
        G, P = cfg.groups, cfg.group_ps
        centre = 1 if G > 1 and cfg.across == "easgd" else 0
        rest = world - centre
        if rest < G or rest % G or rest // G <= P:
            raise ValueError(f"[hierarchical]: {world} ranks cannot make {G} group(s) of {P} group PS(s) and at "
                             f"least one trainer{' plus a centre' if centre else ''}: world = groups * (trainers + "
                             f"group_ps){' + 1' if centre else ''}")
        T = rest // G - P
        how = {"across": cfg.across, "period": cfg.period, "nets": cfg.nets}
        if rank == world - centre and centre:
            return cls(world, G, T, P, rank, "centre", **how)
        g, i = divmod(rank, T + P)
        return cls(world, G, T, P, rank, "trainer" if i < T else "group_ps", g, i if i < T else i - T, **how)

    @property
    def has_centre(self) -> bool:
        return self.groups > 1 and self.across == "easgd"

    def trainer_ranks(self, g: Optional[int] = None) -> list:
        gs = range(self.groups) if g is None else [g]
        return [h * (self.trainers + self.group_ps) + i for h in gs for i in range(self.trainers)]

    def ps_ranks(self, g: int) -> list:
        base = g * (self.trainers + self.group_ps) + self.trainers
        return list(range(base, base + self.group_ps))

    def describe(self) -> str:
        lines = []
        for g in range(self.groups):
            lines.append(f"group {g}: trainer rank(s) {self.trainer_ranks(g)}, group PS rank(s) "
                         f"{self.ps_ranks(g) or '-'}")
        if self.groups > 1 and not self.has_centre:
            lines.append(f"across groups: synchronous all-reduce every {self.period} step(s) (no centre; trainer t "
                         f"and group PS p of each group average with their peers of the other groups)")
        if self.has_centre:
            lines.append(f"centre: rank {self.world - 1} (background EASGD" +
                         (f"; trainer ranks {[self.trainer_ranks(g)[0] for g in range(self.groups)]} exchange for "
                          f"their groups, each group's trainers apply a correction at one step boundary)"
                          if self.trainers > 1 else ")"))
        if self.nets > 1:
            lines.append(f"{self.nets} Hogwild nets a trainer (threads on one dense copy)")
        return "; ".join(lines)


# ---------------------------------------------------------------- the job


class _NoOptimizer:
    """The trainer's optimizer when the plan leaves it no dense weights."""

    def zero_grad(self, set_to_none: bool = True):
        pass

    def step(self):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _flatten(params) -> np.ndarray:
    """Moves `params` into one flat float32 tensor (their data become views of it)
    and returns it as a NumPy array sharing that memory, for the EASGD thread."""
    import torch
    params = list(params)
    if not params:
        return np.zeros(0, np.float32)
    flat = torch.cat([p.detach().reshape(-1) for p in params]).contiguous()
    at = 0
    for p in params:
        n = p.numel()
        p.data = flat[at:at + n].view_as(p)
        at += n
    return flat.numpy()


class _HtDenseSync:
    """Takes DenseSync's place in the Trainer: the group's trainers all-reduce the
    trainer-held gradients, the group PSs step once the group's trainers have all
    asked, and (G > 1) the background average's corrections land on every trainer
    of the group after the same step. A broadcast or all-reduce of the group's
    trainers waits at most ``timeout`` seconds, then raises a CollectiveTimeout
    naming it and ``ranks`` (the group's trainers as the job numbers them)."""

    def __init__(self, split, group_comm, params, average: Optional[GroupAverage], *,
                 timeout: Optional[float] = None, ranks: Optional[Sequence[int]] = None):
        self.split, self.comm, self.params = split, group_comm, list(params)
        self.average = average
        self.timeout, self.ranks = timeout, ranks
        self.merges = 0

    def broadcast_parameters(self) -> None:
        import torch
        bufs = [p.detach().numpy() for p in self.params]
        bcast_within(self.comm, bufs, 0, self.timeout, "the trainer-held layers' first parameters", self.ranks)
        with torch.no_grad():
            for p, buf in zip(self.params, bufs):
                p.copy_(torch.from_numpy(buf))

    def reduce_gradients(self) -> None:
        import torch
        if self.comm.Get_size() == 1:
            return
        bufs = [np.ascontiguousarray((p.grad if p.grad is not None else torch.zeros_like(p)).numpy(), np.float32)
                for p in self.params]
        allreduce_within(self.comm, bufs, self.timeout, "the trainer-held layers' gradients", self.ranks)
        for p, buf in zip(self.params, bufs):
            p.grad = torch.from_numpy(buf)

    def after_step(self, final: bool = False) -> None:
        if final:  # the last exchange's correction (or average) lands before the final evaluation
            self.split.ps_finish()  # on the group PSs' blocks too, not after the trainers stop
            if self.average is not None:
                self.average.finish()
                self.merges = self.average.corrections
            return
        self.split.ps_step()
        if self.average is not None:
            self.average.step()
            self.merges = self.average.corrections

    def state_dict(self) -> dict:
        # (The average's at this step boundary: with a background exchange, once it settled.)
        return {"merges": self.merges, "average": self.average.state_dict() if self.average is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.merges = state.get("merges", 0)
        if self.average is not None and state.get("average") is not None:
            self.average.load_state_dict(state["average"])


def _save_checkpoint_files(directory: str, trainer, roles: Roles, cfg: HierarchicalConfig, split, plan,
                           easgd_comms) -> None:
    """A trainer rank's part of an HT checkpoint, into its checkpoint's directory
    before the checkpoint is named (so a crash leaves all of it or the previous
    checkpoint): the layout and plan (every trainer rank), its group PSs' blocks
    (the group's first trainer), the centre's parts (trainer rank 0, once every
    group's exchanges have settled: each group's trainer 0 waited for its own when
    its dense state was taken, each group PS when its blocks were)."""
    import io
    import json
    import torch
    from hps.hierarchical.split_mlp import FINISH_WAITS
    from hps.jobdir import HT_CENTRE, HT_GROUP_PS, HT_LAYOUT, write_checkpoint_file
    write_checkpoint_file(directory, HT_LAYOUT, json.dumps({"layout": _layout(roles, cfg),
                                                             "plan": _plan_dict(plan)}).encode())
    if roles.index == 0:
        for p, data in enumerate(split.ps_save()):
            write_checkpoint_file(directory, HT_GROUP_PS.format(p), data)
    if roles.has_centre:
        trainer.node.allgather("train", None, "the group PSs' blocks checkpointed")
        if roles.rank == 0:
            parts = [centre_state(comm, roles.world - 1, FINISH_WAITS * cfg.timeout) for comm in easgd_comms]
            buf = io.BytesIO()
            torch.save(parts, buf)
            write_checkpoint_file(directory, HT_CENTRE, buf.getvalue())


def _plan_for(mlp, cfg: HierarchicalConfig):
    from hps.hierarchical.planner import linear_shapes, plan
    from hps.hierarchical.split_mlp import FcPlacement, SplitPlan
    shapes = linear_shapes(mlp)
    if cfg.group_ps == 0:
        return SplitPlan([FcPlacement() for _ in shapes], 1)
    if cfg.placement:
        from hps.hierarchical.split_mlp import segments
        if len(cfg.placement) != len(shapes):
            raise ValueError(f"[hierarchical] placement names {len(cfg.placement)} Linear layers, the MLP has "
                             f"{len(shapes)}")
        fixed = SplitPlan([parse_placement(s, f"[hierarchical] placement[{j}]") for j, s in
                           enumerate(cfg.placement)], cfg.group_ps)
        try:  # (here, not in SplitTrainer: the error names the field)
            segments(mlp, fixed)
        except ValueError as e:
            raise ValueError(f"[hierarchical] placement {list(cfg.placement)!r} does not fit the MLP: {e}") from None
        return fixed
    return plan(shapes, cfg.planner_config()).plan


def _serve_group_ps(world, roles: Roles, cfg: HierarchicalConfig, train_cfg, easgd_comms, across_comm) -> dict:
    """A group PS's life: the MLP and plan from its group's trainer 0, its blocks
    served until the group's trainers stop, EASGD of its blocks in the background."""
    from hps.hierarchical.codecs import CodecStreams
    from hps.hierarchical.split_mlp import GroupPsServer, serve
    from hps.tuning import dense_adam, import_torch
    # The PS's own measured time (CPU of every thread of this process, and wall), for a
    # benchmark to hold against the planner's modelled per-node time.
    cpu0, wall0 = time.process_time(), time.perf_counter()
    import_torch()
    leader = roles.trainer_ranks(roles.group)[0]
    # Sleeps between probes while the trainer starts (its data and embeddings can take a
    # while): a blocking recv would spin a core away from it. `saved`: a resumed job's
    # state of this PS (torch.save's bytes) from the file `where` of the leader's checkpoint.
    mlp, plan, saved, where = poll.recv(world, leader, 51)
    codecs = CodecStreams({"activations": cfg.activations, "gradients": cfg.gradients,
                           "averaging": cfg.averaging})
    holder: dict = {}

    def make_optimizer(params):
        holder["live"] = _flatten(params)
        return dense_adam(params, train_cfg.dense_lr)

    server = GroupPsServer(mlp, plan, roles.index, make_optimizer, codecs, trainers=roles.trainers)
    average = None
    if across_comm is not None:  # synchronous: PS p of every group averages its blocks right after a step
        average = AllreduceAverage(holder.get("live", np.zeros(0, np.float32)), across_comm, cfg.period,
                                   server.counter, timeout=cfg.timeout,
                                   what=f"group PS {roles.index}'s average of its blocks across groups",
                                   ranks=[roles.ps_ranks(g)[roles.index] for g in range(roles.groups)])
        server.on_step = average.step
    elif roles.groups > 1:
        comm = easgd_comms[1 + roles.index]
        live = holder.get("live", np.zeros(0, np.float32))
        if roles.group == 0 and saved is None:  # (resumed: trainer rank 0 sends the checkpoint's centre)
            comm.send({"centre": live.copy(), "exchanges": 0}, dest=roles.world - 1, tag=40)
        client = EasgdClient(comm, roles.world - 1, roles.group, EasgdConfig(cfg.alpha, cfg.period), codecs,
                             server.counter, timeout=cfg.timeout)
        # The PS holds the only copy of its blocks; a correction lands in the serve loop
        # right after a step (the one all T trainers asked for), so every trainer's
        # forward and backward of the next step see the same blocks.
        average = GroupAverage(live, BackgroundEasgd(client, live))
        server.on_step = average.step
    if average is not None:
        # At the trainers' "finish" (after their last step, before their final
        # evaluation); again after serve, a no-op then.
        server.on_finish = average.finish
        server.on_save = average.state_dict
    if saved is not None:
        import io
        import torch
        state = torch.load(io.BytesIO(saved), weights_only=False, map_location="cpu")
        server.load_state_dict(state, f"{where} (rank {leader}'s checkpoint)")
        if average is not None and state.get("averaging") is not None:
            average.load_state_dict(state["averaging"])
    serve(world, server, trainers=roles.trainers, idle_timeout=None)
    if average is not None:
        average.finish()
    return {"role": "group_ps", "group": roles.group, "index": roles.index, "steps": server.steps,
            "resumed": saved is not None,
            "exchanges": _exchanges(average),
            "corrections": average.corrections if average is not None else 0,
            "bytes": server.counter.as_dict(), "cpu_seconds": time.process_time() - cpu0,
            "wall_seconds": time.perf_counter() - wall0}


def _exchanges(average) -> int:
    """Background exchanges this rank ran with the centre (0 without one)."""
    if average is None or average.background is None:
        return 0
    return average.background.client.exchanges


def _serve_centre(roles: Roles, cfg: HierarchicalConfig, easgd_comms) -> dict:
    from mpi4py import MPI
    from hps.hierarchical.codecs import ByteCounter, CodecStreams
    cpu0, wall0 = time.process_time(), time.perf_counter()
    codecs = CodecStreams({"averaging": cfg.averaging})
    counter = ByteCounter()
    parts = 1 + roles.group_ps
    errors: list = []
    ended = threading.Condition()  # a part's thread ended, or failed
    finished: list = []
    centres: list = [None] * parts
    starts: list = [None] * parts  # each part's first centre (a CRC-32 of its bytes) and exchanges

    def run(k: int) -> None:
        try:
            serve_part(k)
        except BaseException as e:  # noqa: BLE001 - reported below, in the main thread
            with ended:
                errors.append(e)
        finally:
            with ended:
                finished.append(k)
                ended.notify_all()

    def serve_part(k: int) -> None:
        comm = easgd_comms[k]
        # The first state: group 0's replica of part k (from its holder), or a resumed
        # job's checkpointed centre (from trainer rank 0). Sleeps between probes, as
        # every wait of the centre.
        start = poll.recv(comm, MPI.ANY_SOURCE, 40)
        ranks = [roles.trainer_ranks(g)[0] if k == 0 else roles.ps_ranks(g)[k - 1] for g in range(roles.groups)]
        centres[k] = EasgdCentre(comm, start["centre"].copy(), ranks, EasgdConfig(cfg.alpha, cfg.period), codecs,
                                 counter)
        centres[k].load_state_dict(start)
        starts[k] = {"crc32": zlib.crc32(start["centre"].tobytes()), "exchanges": int(start["exchanges"])}
        # Until trainer rank 0 releases it: its last checkpoint, after the groups stopped, asks for the centre.
        centres[k].serve(timeout=max(cfg.timeout, 3600.0), until_released=True)

    # (Daemons: a failed part ends the job while the others still serve.)
    threads = [threading.Thread(target=run, args=(k,), name=f"hps-centre-{k}", daemon=True) for k in range(parts)]
    for t in threads:
        t.start()
    with ended:
        # A part that failed is raised at once (the caller ends the job naming it): the
        # other parts serve until the job releases them, and the failed part's groups,
        # unanswered, would end the job at their timeout saying the centre died or hung.
        ended.wait_for(lambda: errors or len(finished) == parts)
        if errors:
            raise errors[0]
    for t in threads:
        t.join()
    return {"role": "centre", "exchanges": sum(c.easgd.exchanges for c in centres if c is not None), "starts": starts,
            "bytes": counter.as_dict(), "cpu_seconds": time.process_time() - cpu0,
            "wall_seconds": time.perf_counter() - wall0}


def train_hierarchical(train_cfg, cfg: HierarchicalConfig, *, resume: bool = False, progress: bool = True,
                       train_batches=None, eval_batches=None, comm=None, return_mlp: bool = False,
                       report=None) -> dict:
    """One rank of an HT job (every rank calls it with the same configs). Trainers
    return hps.train.train's summary with a "hierarchical" entry (roles, plan,
    bytes per traffic kind; with `return_mlp` the group's whole MLP, its PSs' blocks
    put back together, as {name: array}); group PSs and the centre return what they
    did. `report`: as hps.train.train's, checked by every rank of the job."""
    from mpi4py import MPI

    cfg.check()
    world = comm if comm is not None else MPI.COMM_WORLD
    roles = Roles.layout(world.Get_size(), world.Get_rank(), cfg)
    if resume or report is not None:  # (before the try: refused alike on every rank, nothing is left waiting)
        _agree_before_job(world, train_cfg, roles, resume, report)
    job_comms = _JobComms()
    try:
        result = _run_role(world, roles, job_comms, train_cfg, cfg, resume=resume, progress=progress,
                           train_batches=train_batches, eval_batches=eval_batches, return_mlp=return_mlp)
    except Exception as e:  # noqa: BLE001 - the job's other ranks would wait for this one for ever
        if world.Get_size() == 1:
            job_comms.free()
            raise
        # (Returning would leave this rank in MPI_Finalize, waiting for peers that wait
        # for it: a trainer whose dense hook failed left its group PSs waiting for the
        # MLP, and the job hung until killed. The communicators are not freed first:
        # freeing is collective, and the peers may never come to it; the abort ends
        # the processes that hold them.)
        import traceback
        from hps.distributed.comm import abort_job
        abort_job(world, f"hps.hierarchical: rank {roles.rank} ({_role_name(roles)}): {type(e).__name__}: {e}",
                  code=1, detail=traceback.format_exc())
        raise  # (MPICH's MPI_Abort returns: the launcher ends the process a moment later)
    job_comms.free()
    return result


class _JobComms:
    """The communicators a job makes on this rank (and its hps.distributed Node's),
    freed when the job ends. MPI caps the communicators a process holds at once
    (MPICH: 2048) and a job makes about 10 a rank, so a process that runs jobs one
    after another (a user's trainer, the tests) ran out of them when none was freed.
    MPI_Comm_free is collective over a communicator's ranks: every rank frees the
    ones it belongs to, in the same order, the last made first (a Dup before the
    communicator it was made from)."""

    def __init__(self):
        self.comms: list = []
        self.node = None  # the trainer's Node (its Dups of the trainers' communicator)

    def add(self, comm):
        """Keeps comm to free (not MPI.COMM_NULL: a Split this rank is not in); returns it."""
        from mpi4py import MPI
        if comm != MPI.COMM_NULL:
            self.comms.append(comm)
        return comm

    def free(self) -> None:
        """Once every thread that used them has ended (again: a no-op)."""
        if self.node is not None:
            self.node.close()  # (train() closes it at its end already; a no-op then)
            self.node = None
        while self.comms:
            self.comms.pop().Free()


def _role_name(roles: Roles) -> str:
    if roles.role == "centre":
        return "the EASGD centre"
    return f"{'trainer' if roles.role == 'trainer' else 'group PS'} {roles.index} of group {roles.group}"


def _agree_before_job(world, train_cfg, roles: Roles, resume: bool, report) -> None:
    """_check_resumable (with `resume`) and the check of the --report directory
    (hps.train.check_output_outside_data) on every rank, then the ranks' verdicts
    exchanged: if one failed on any rank, every rank raises ValueError naming the
    ranks and the error (hps train exits 2, as on every other --resume refusal: a
    damaged job.json named with the file and the field), before anything of the job
    is made or touched. Raised on one rank only, the others would wait for it in the
    job's first exchanges: so it went through abort_job (exit 1, "aborting the
    job") like a failure inside the job. (The report's path may lead into the data
    from one rank's working directory alone.)"""
    def check() -> None:
        if resume:
            _check_resumable(train_cfg, roles)
        if report is not None:
            from hps.train import check_output_outside_data
            check_output_outside_data(train_cfg, report, "--report", "the report's plots", "write them elsewhere")
    if world.Get_size() == 1:
        check()
        return
    error = None
    try:
        check()
    except Exception as e:  # noqa: BLE001 - the peers wait for this rank's word
        error = f"{type(e).__name__}: {e}"
    ranks: dict = {}
    for r, e in enumerate(world.allgather(error)):
        if e is not None:
            ranks.setdefault(e, []).append(r)
    if ranks:  # (every rank reads the same job.json: one error, said once)
        raise ValueError("; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {e}"
                                   for e, rs in ranks.items()))


def _check_resumable(train_cfg, roles: Roles) -> None:
    """Every rank, before the job starts: a checkpointed job of another number of
    trainer ranks cannot resume (hps.train would reshard its embeddings, but not the
    group PSs' blocks or the centre)."""
    import os
    from hps.jobdir import JOB_MANIFEST, read_job_record
    manifest = os.path.join(train_cfg.ps.path, JOB_MANIFEST)
    if not os.path.exists(manifest):
        return
    job = read_job_record(manifest)  # (damaged: every rank names the file and the field)
    trainers = roles.groups * roles.trainers
    if job["checkpoint"] is not None and job["world"] != trainers:
        raise ValueError(f"--resume: the job at {train_cfg.ps.path} ran {job['world']} trainer rank(s) "
                         f"({manifest}), this [hierarchical] layout of {roles.world} ranks has {trainers} "
                         f"({roles.groups} group(s) of {roles.trainers}): a hierarchical job cannot be resharded "
                         f"onto another number of ranks; resume it with its own layout and mpiexec -n")


def _layout(roles: Roles, cfg: HierarchicalConfig) -> dict:
    """What a resumed job must run as its checkpoint did (HT_LAYOUT holds it, with the plan)."""
    return {"groups": roles.groups, "trainers": roles.trainers, "group_ps": roles.group_ps,
            "across": cfg.across if roles.groups > 1 else None, "nets": cfg.nets}  # (one group: no average)


def _plan_dict(plan) -> dict:
    from dataclasses import asdict
    return {"group_ps": plan.group_ps, "fcs": [asdict(p) for p in plan.fcs]}


def _plan_names(plan) -> list:
    return [placement_name(p) for p in plan.fcs]


def _resumed_plan(directory: str, roles: Roles, cfg: HierarchicalConfig, mlp):
    """The plan of the checkpoint in `directory` (this trainer rank's), once its
    layout is this run's; a placement given must be the one checkpointed (with
    none, the planner does not run again: its refinement stops at a time limit, so
    it could split otherwise). ValueError naming the file and what differs."""
    import json
    import os
    from hps.hierarchical.split_mlp import FcPlacement, SplitPlan
    from hps.jobdir import HT_LAYOUT
    path = os.path.join(directory, HT_LAYOUT)
    if not os.path.exists(path):
        raise FileNotFoundError(f"--resume: {path} is missing (rank {roles.rank}): the checkpoint was not written "
                                f"by a hierarchical job; resume it without [hierarchical]")
    with open(path) as f:
        saved = json.load(f)
    mine = _layout(roles, cfg)
    differ = [f"{k} = {saved['layout'].get(k)!r} there, {v!r} here" for k, v in mine.items()
              if saved["layout"].get(k) != v]
    if differ:
        raise ValueError(f"--resume: the checkpoint's [hierarchical] layout ({path}, rank {roles.rank}) is not this "
                         f"run's: {'; '.join(differ)}; resume with the job's layout")
    plan = SplitPlan([FcPlacement(**d) for d in saved["plan"]["fcs"]], saved["plan"]["group_ps"])
    if cfg.placement or cfg.group_ps == 0:
        wanted = _plan_for(mlp, cfg)
        if _plan_dict(wanted) != saved["plan"]:
            raise ValueError(f"--resume: the checkpoint's split of the MLP ({path}, rank {roles.rank}) is "
                             f"{_plan_names(plan)}, this run's placement gives {_plan_names(wanted)}; resume with "
                             f"the job's placement (or none: the checkpoint's plan is kept)")
    return plan


def _read_checkpoint_file(directory: str, name: str, what: str) -> bytes:
    import os
    path = os.path.join(directory, name)
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"--resume: {path} is missing: the checkpoint lacks {what}") from None


def _run_role(world, roles: Roles, job_comms: _JobComms, train_cfg, cfg: HierarchicalConfig, *, resume: bool,
              progress: bool, train_batches, eval_batches, return_mlp: bool) -> dict:
    """train_hierarchical's work on this rank, in its role; the communicators it
    makes go to `job_comms`, for the caller to free."""
    from mpi4py import MPI
    from hps.distributed import Node
    from hps.hierarchical.codecs import CodecStreams
    from hps.hierarchical.split_mlp import MpiTransport, SplitTrainer
    from hps.train import train
    from hps.tuning import dense_adam

    trainers_comm = job_comms.add(world.Split(0 if roles.role == "trainer" else MPI.UNDEFINED, world.Get_rank()))
    group_comm = job_comms.add(world.Split(roles.group if roles.role == "trainer" else MPI.UNDEFINED, world.Get_rank()))
    easgd_comms = [job_comms.add(world.Dup()) for _ in range(1 + cfg.group_ps)] if roles.has_centre else []
    across_comm = None
    if roles.groups > 1 and not roles.has_centre:
        # Trainer t of every group (color t), group PS p of every group (color T + p), ordered by group.
        color = roles.index if roles.role == "trainer" else roles.trainers + roles.index
        across_comm = job_comms.add(world.Split(color, roles.group))
    if roles.role == "group_ps":
        return _serve_group_ps(world, roles, cfg, train_cfg, easgd_comms, across_comm)
    if roles.role == "centre":
        return _serve_centre(roles, cfg, easgd_comms)

    codecs = CodecStreams({"activations": cfg.activations, "gradients": cfg.gradients,
                           "averaging": cfg.averaging})
    made: dict = {}

    def hook(trainer) -> None:
        from hps.jobdir import HT_CENTRE, HT_GROUP_PS
        mlp = trainer.model.mlp
        # The checkpoint the job resumes from (None: none), this rank's.
        directory = trainer.local_ps.checkpoint_dir()
        if directory is not None:  # (every trainer rank of the job, or none)
            plan = _resumed_plan(directory, roles, cfg, mlp)
        else:
            # One plan for the job, the first trainer's: the planner's refinement stops at a
            # time limit, so trainers planning on their own could stop at different moves on a
            # loaded machine, and a trainer, its group PSs or another group (whose blocks
            # average with these) would then hold other layers.
            plan = _plan_for(mlp, cfg) if trainers_comm.Get_rank() == 0 else None
            plan = trainers_comm.bcast(plan, root=0)
        ps_ranks = roles.ps_ranks(roles.group)
        if roles.index == 0:
            names = [HT_GROUP_PS.format(p) for p in range(len(ps_ranks))]
            saved = [None] * len(ps_ranks) if directory is None else [
                _read_checkpoint_file(directory, name, f"the blocks of group PS {p} of group {roles.group} (rank "
                                                       f"{r}), which rank {roles.rank} saves")
                for p, (name, r) in enumerate(zip(names, ps_ranks))]
            for r, name, data in zip(ps_ranks, names, saved):
                world.send((mlp, plan, data, name), dest=r, tag=51)
        transport = MpiTransport(world, ps_ranks, timeout=cfg.timeout, tag=1)
        split = SplitTrainer(mlp, plan, transport, codecs)
        trainer.model.mlp = split
        params = list(split.parameters())
        live = _flatten(params)
        trainer.opt = dense_adam(params, train_cfg.dense_lr) if params else _NoOptimizer()
        average = None
        if across_comm is not None:
            average = AllreduceAverage(live, across_comm, cfg.period, split.counter, timeout=cfg.timeout,
                                       what=f"trainer {roles.index}'s average of its layers across groups",
                                       ranks=[roles.trainer_ranks(g)[roles.index] for g in range(roles.groups)])
        elif roles.groups > 1:
            background = None
            if roles.index == 0:  # the group's trainer 0 exchanges; the group's trainers all apply
                if roles.group == 0 and directory is not None:  # every part's centre, as checkpointed
                    import io
                    import torch
                    data = _read_checkpoint_file(directory, HT_CENTRE, f"the EASGD centre (rank {roles.world - 1})")
                    starts = torch.load(io.BytesIO(data), weights_only=False)
                    if len(starts) != len(easgd_comms):
                        raise ValueError(f"--resume: {directory}/{HT_CENTRE} holds {len(starts)} part(s) of the "
                                         f"centre, this layout has {len(easgd_comms)}")
                    for comm, start in zip(easgd_comms, starts):
                        comm.send(start, dest=roles.world - 1, tag=40)
                elif roles.group == 0:
                    easgd_comms[0].send({"centre": live.copy(), "exchanges": 0}, dest=roles.world - 1, tag=40)
                client = EasgdClient(easgd_comms[0], roles.world - 1, roles.group,
                                     EasgdConfig(cfg.alpha, cfg.period), codecs, split.counter, timeout=cfg.timeout)
                background = BackgroundEasgd(client, live)
            average = GroupAverage(live, background, group_comm, root=0, timeout=cfg.timeout,
                                   ranks=roles.trainer_ranks(roles.group))
        trainer.dense_sync = _HtDenseSync(split, group_comm, params, average, timeout=cfg.timeout,
                                          ranks=roles.trainer_ranks(roles.group))
        made.update(split=split, plan=plan, average=average, hogwild=None)
        trainer.checkpoint_files = lambda d: _save_checkpoint_files(d, trainer, roles, cfg, split, plan, easgd_comms)
        if cfg.nets > 1:
            from hps.hierarchical.hogwild import install
            made["hogwild"] = install(
                trainer, cfg.nets, lambda ps: dense_adam(ps, train_cfg.dense_lr), live,
                transport_for=lambda r: MpiTransport(world, ps_ranks, timeout=cfg.timeout, tag=HOGWILD_TAG + r),
                group_comms=[job_comms.add(group_comm.Dup()) for _ in range(cfg.nets)] if roles.trainers > 1 else None,
                group_comm=group_comm, timeout=cfg.timeout, group_ranks=roles.trainer_ranks(roles.group))

    node = job_comms.node = Node(train_cfg.distributed, comm=trainers_comm)
    cpu0, wall0 = time.process_time(), time.perf_counter()  # the trainer's measured time, as the PS's
    summary = train(train_cfg, resume=resume, progress=progress, train_batches=train_batches,
                    eval_batches=eval_batches, node=node, dense_hook=hook)
    if roles.has_centre and roles.rank == 0:  # its last checkpoint is written: the centre may end
        for comm in easgd_comms:
            release_centre(comm, roles.world - 1)
    cpu_seconds, wall_seconds = time.process_time() - cpu0, time.perf_counter() - wall0
    split = made["split"]
    hogwild = made["hogwild"]
    if hogwild is not None:
        hogwild.close()
    corrections = 0
    average = made["average"]
    if average is not None:
        average.finish()  # done already by the final after_step; a no-op then
        corrections = average.corrections
    exchanges = _exchanges(average)
    mlp = {n: v for n, (v, _) in split.full_state().items()} if return_mlp else None
    split.stop()
    summary["hierarchical"] = {"roles": roles.describe(), "group": roles.group, "trainer": roles.index,
                               "plan": _plan_names(made["plan"]),
                               "bytes": split.counter.as_dict(), "exchanges": exchanges,
                               "corrections": corrections, "cpu_seconds": cpu_seconds,
                               "wall_seconds": wall_seconds, "nets": cfg.nets}
    if hogwild is not None:
        summary["hierarchical"]["net_examples"] = list(hogwild.examples)  # each net's share of this trainer's
    if return_mlp:
        summary["hierarchical"]["mlp"] = mlp
    return summary
