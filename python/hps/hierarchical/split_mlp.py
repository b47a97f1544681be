"""An MLP split over a group's trainer and group parameter servers (HT, section 4.2).

A placement plan (:class:`SplitPlan`) says, for every ``nn.Linear`` of an
``nn.Sequential`` of Linear and element-wise activation layers, where it runs:

  trainer                 the trainer computes it (with its own optimizer);
  ps, split "none"        one group PS (``ps``) holds the whole layer;
  ps, split "vertical"    each of the P group PSs holds a contiguous block of the
                          output columns (rows of the weight and of the bias); the
                          trainer sends every PS the whole input and concatenates;
  ps, split "horizontal"  each PS holds a block of the input rows (columns of the
                          weight); the trainer sends each PS its block of the input
                          and sums the partial outputs; PS 0 adds the bias;
  pair = True             co-partitioned with the next Linear (the paper's rule: this
                          one's output wider than its input, the next one's output
                          narrower than its input): this one split vertically, the
                          activations between them on the PSs, the next split
                          horizontally over the same blocks, so that the wide
                          intermediate never returns to the trainer; the trainer sums
                          the partial outputs.

The backward pass mirrors the forward one: the trainer sends output gradients, the
PSs return input gradients (summed or concatenated as the forward pass was) and
keep their weights' gradients; ``step`` makes every PS apply its optimizer to the
weights it holds. Forward tensors go through the ``activations`` codec, backward
ones through the ``gradients`` codec (:class:`~hps.hierarchical.codecs.CodecStreams`),
their bytes counted before and after.

The trainer's side is :class:`SplitTrainer` (an ``nn.Module``: the trainer's layers
plus one remote segment per PS-held layer or pair); a PS's side is
:class:`GroupPsServer`, served over MPI by :func:`serve` or called in-process
through :class:`LocalTransport`. Every node builds the full model from the same
seed and keeps only its own blocks.
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from hps.distributed import poll
from hps.errors import DivergedError, HpsError
from hps.hierarchical.codecs import ByteCounter, CodecStreams, decode, refuse_unsendable
# (The plan and its checks need no torch: a config is checked, and hps plan plans, without it.)
from hps.hierarchical.placement import FcPlacement, SplitPlan, blocks, check_plan

__all__ = ["FcPlacement", "SplitPlan", "Segment", "segments", "blocks", "GroupPsServer", "SplitTrainer",
           "LocalTransport", "MpiTransport", "GroupPsTimeout", "FINISH_WAITS", "serve", "assemble_state", "shared_copy", "ELEMENTWISE"]

# Activations that act on each value alone, so that a PS may apply them to its block.
ELEMENTWISE = (nn.ReLU, nn.LeakyReLU, nn.Sigmoid, nn.Tanh, nn.GELU, nn.ELU, nn.SiLU, nn.Identity)


DEFER = "defer"  # GroupPsServer.handle's answer to a step request that waits for the group's other trainers
# A trainer waits for a group PS's answer to "finish" up to this many times the transport's
# timeout: the PS answers once its averaging's finish has run, and with EASGD that waits on
# the centre twice, each wait bounded by the same timeout (the exchange in flight or due at
# the last step, then the group's stop); the third is for the PS's own work around them. One
# timeout would fail a PS busy within its own bounds, naming the PS where the centre was slow.
FINISH_WAITS = 3


class GroupPsTimeout(HpsError):
    """A group PS did not answer within the timeout (it died or hung)."""


@dataclass
class Segment:
    """Modules [start, stop) of the Sequential that run together on one side."""
    kind: str                # "local" (the trainer), "fc" (one PS-held Linear) or "pair"
    start: int
    stop: int
    fcs: tuple = ()          # the Linears' positions in the Sequential
    placement: Optional[FcPlacement] = None
    name: str = ""           # a PS segment's Linears as hps plan names them: "fc1", "fc0+fc1" (a pair)


def linear_indices(seq: nn.Sequential) -> list:
    if not isinstance(seq, nn.Sequential):
        raise TypeError(f"the dense model must be an nn.Sequential, got {type(seq).__name__}")
    out = []
    for i, m in enumerate(seq):
        if isinstance(m, nn.Linear):
            out.append(i)
        elif not isinstance(m, ELEMENTWISE):
            raise TypeError(f"module {i} of the Sequential is {type(m).__name__}: only nn.Linear and element-wise "
                            f"activations ({', '.join(t.__name__ for t in ELEMENTWISE)}) can be placed")
    if not out:
        raise ValueError("the Sequential has no nn.Linear to place")
    return out


def segments(seq: nn.Sequential, plan: SplitPlan) -> list:
    """Checks `plan` against `seq` (placement.check_plan: errors name the Linear as hps
    plan does, fc<j>, and its module in the Sequential) and cuts the Sequential into
    segments."""
    fcs = linear_indices(seq)
    if not isinstance(plan, SplitPlan):
        raise TypeError(f"plan must be a SplitPlan, got {type(plan).__name__}")
    if len(plan.fcs) != len(fcs):
        raise ValueError(f"the plan places {len(plan.fcs)} Linear layers, the Sequential has {len(fcs)}")
    check_plan([(seq[i].in_features, seq[i].out_features) for i in fcs], plan, fcs)
    out: list = []
    pos, j = 0, 0
    while j < len(fcs):
        i, pl = fcs[j], plan.fcs[j]
        if pl.where == "trainer":
            j += 1
            continue
        if pos < i:
            out.append(Segment("local", pos, i))
        if pl.pair:
            out.append(Segment("pair", i, fcs[j + 1] + 1, (i, fcs[j + 1]), pl, f"fc{j}+fc{j + 1}"))
            pos, j = fcs[j + 1] + 1, j + 2
        else:
            out.append(Segment("fc", i, i + 1, (i,), pl, f"fc{j}"))
            pos, j = i + 1, j + 1
    if pos < len(seq):
        out.append(Segment("local", pos, len(seq)))
    return out


def _participants(seg: Segment, P: int) -> list:
    return [seg.placement.ps] if seg.placement.split == "none" else list(range(P))


def _slice_linear(lin: nn.Linear, rows=None, cols=None, bias: bool = True) -> nn.Linear:
    w = lin.weight.detach()
    w = w[rows[0]:rows[1]] if rows else w
    w = w[:, cols[0]:cols[1]] if cols else w
    has_bias = bias and lin.bias is not None
    out = nn.Linear(w.shape[1], w.shape[0], bias=has_bias)
    with torch.no_grad():
        out.weight.copy_(w)
        if has_bias:
            b = lin.bias.detach()
            out.bias.copy_(b[rows[0]:rows[1]] if rows else b)
    return out


def _shard(seq: nn.Sequential, seg: Segment, p: int, P: int) -> nn.Sequential:
    """Group PS p's part of a PS segment, as a module from its input block to its output part."""
    pl = seg.placement
    if seg.kind == "fc":
        lin = seq[seg.start]
        if pl.split == "none":
            return nn.Sequential(_slice_linear(lin))
        if pl.split == "vertical":
            return nn.Sequential(_slice_linear(lin, rows=blocks(lin.out_features, P)[p]))
        return nn.Sequential(_slice_linear(lin, cols=blocks(lin.in_features, P)[p], bias=p == 0))
    first, second = seq[seg.fcs[0]], seq[seg.fcs[1]]
    blk = blocks(first.out_features, P)[p]
    mid = [copy.deepcopy(seq[k]) for k in range(seg.fcs[0] + 1, seg.fcs[1])]
    return nn.Sequential(_slice_linear(first, rows=blk), *mid, _slice_linear(second, cols=blk, bias=p == 0))


# ---------------------------------------------------------------- the group PS


class GroupPsServer:
    """Group PS `index`'s blocks of every PS segment, its optimizer and the
    activations kept between a forward call and its backward one.

    Requests (tuples): ("forward", seg, call, x, keep) -> y part (keep: hold the
    activations for a backward pass); ("backward", seg, call,
    dy, want_dx) -> dx part or None; ("step",) applies the optimizer to the
    gradients gathered since the last step once `trainers` trainers have asked
    (DEFER until then: serve answers them all together); ("finish",) after the last
    step, answered (as a step) once every trainer has asked: runs `on_finish` (the
    last averaging of its blocks lands before the trainers' final evaluation);
    ("state",) -> {name: (weight, grad)} of its blocks; ("save",) -> its
    state_dict as torch.save's bytes (for a checkpoint, at a step boundary); ("stop",).
    Tensors travel as codec payloads."""

    def __init__(self, seq: nn.Sequential, plan: SplitPlan, index: int,
                 make_optimizer: Callable, codecs: Optional[CodecStreams] = None,
                 counter: Optional[ByteCounter] = None, trainers: int = 1):
        self.index = index
        self.trainers = trainers  # a step is taken once this many trainers have asked (their gradients summed)
        self._asked = 0
        self.on_step: Optional[Callable] = None  # called after each step (the group PS's EASGD thread)
        self.on_finish: Optional[Callable] = None  # called once every trainer has asked "finish"
        self.on_save: Optional[Callable[[], dict]] = None  # the averaging's state, saved with the blocks
        self._finishing = 0
        self.plan = plan
        P = plan.group_ps
        if not 0 <= index < P:
            raise ValueError(f"GroupPsServer: index {index} out of range [0, {P})")
        self.segments = {s.start: s for s in segments(seq, plan) if s.kind != "local"}
        self.shards = {k: _shard(seq, s, index, P) for k, s in self.segments.items()
                       if index in _participants(s, P)}
        params = [p for m in self.shards.values() for p in m.parameters()]
        self.optimizer = make_optimizer(params) if params else None
        self.codecs = codecs or CodecStreams()
        self.counter = counter or ByteCounter()
        self.saved: dict = {}
        self.steps = 0

    def _encode(self, kind: str, key, t: torch.Tensor):
        x = t.detach().contiguous().numpy()
        return self.counter.encode(self.codecs.get(kind, key + (x.shape,)), kind, x)  # a stream a shape

    def _unsendable(self, kind: str, t: torch.Tensor, what: str) -> Optional[DivergedError]:
        """The refusal of t (refuse_unsendable: a value that is not finite, or that the
        bf16 codec rounds to an infinity), which the trainer raises as its answer;
        None where t can go. The trainer's weights (its layers after this one's, or
        before) would step with the infinity and go NaN."""
        spec = self.codecs.spec[kind]
        try:
            refuse_unsendable(t.detach().numpy(), spec, f"group PS {self.index}, {what}",
                              f"[hierarchical] {kind} = {spec!r} carries such values to the trainer; the group "
                              f"PS sent its refusal instead")
        except DivergedError as refused:
            return refused
        return None

    def handle(self, src: int, msg: tuple):
        op = msg[0]
        if op == "forward":
            _, seg, call, enc, keep = msg
            x = torch.from_numpy(decode(enc).copy()).requires_grad_(keep)
            with torch.set_grad_enabled(keep):  # in-process, this runs inside the trainer's autograd Function
                y = self.shards[seg](x)
            refused = self._unsendable("activations", y, f"{self.segments[seg].name}: its output for rank {src}")
            if refused is not None:
                return refused
            if keep:  # for the backward pass; evaluation sends keep = False
                self.saved[src, call, seg] = (x, y)
            return self._encode("activations", ("fwd", src, seg), y)
        if op == "backward":
            _, seg, call, enc, want_dx = msg
            x, y = self.saved.pop((src, call, seg))
            with torch.enable_grad():
                y.backward(torch.from_numpy(decode(enc).copy()))
            if not want_dx:
                return None
            refused = self._unsendable("gradients", x.grad, f"{self.segments[seg].name}: the gradient of its input "
                                                            f"for rank {src}")
            return refused if refused is not None else self._encode("gradients", ("bwd", src, seg), x.grad)
        if op == "step":
            self._asked += 1
            if self._asked < self.trainers:
                return DEFER
            self._asked = 0
            if self.optimizer is not None:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
            self.steps += 1
            if self.on_step is not None:
                self.on_step()
            return self.steps
        if op == "finish":
            self._finishing += 1
            if self._finishing < self.trainers:
                return DEFER
            self._finishing = 0
            if self.on_finish is not None:
                self.on_finish()
            return "finished"
        if op == "state":
            return {f"{seg}.{name}": (p.detach().numpy().copy(),
                                      None if p.grad is None else p.grad.detach().numpy().copy())
                    for seg, m in self.shards.items() for name, p in m.named_parameters()}
        if op == "save":
            import io
            buf = io.BytesIO()
            torch.save(self.state_dict(), buf)
            return buf.getvalue()
        if op == "stop":
            return "stopped"
        raise ValueError(f"group PS {self.index}: unknown request {op!r} from rank {src}")

    def state_dict(self) -> dict:
        """Its blocks ({"<segment>.<name>": tensor}), their optimizer's state, the steps
        taken and (``on_save``) the averaging's state: what a checkpoint keeps of it."""
        return {"index": self.index,
                "blocks": {f"{seg}.{name}": p.detach().clone() for seg, m in self.shards.items()
                           for name, p in m.named_parameters()},
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "steps": self.steps, "averaging": self.on_save() if self.on_save is not None else None}

    def load_state_dict(self, state: dict, where: str = "the checkpoint") -> None:
        """A state_dict of this PS's blocks (the same plan and model) into it; the
        averaging's state is the caller's (state["averaging"]). ValueError naming
        `where` when it holds other blocks."""
        mine = {f"{seg}.{name}": p for seg, m in self.shards.items() for name, p in m.named_parameters()}
        saved = state.get("blocks", {})
        if state.get("index") != self.index or set(saved) != set(mine) or any(
                tuple(saved[k].shape) != tuple(p.shape) for k, p in mine.items()):
            raise ValueError(f"group PS {self.index}: {where} holds group PS {state.get('index')}'s blocks "
                             f"{ {k: tuple(v.shape) for k, v in saved.items()} }, this plan gives it "
                             f"{ {k: tuple(p.shape) for k, p in mine.items()} }")
        with torch.no_grad():
            for k, p in mine.items():
                p.copy_(saved[k])  # (in place: the flat memory the averaging shares stays)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])


# ---------------------------------------------------------------- transports


class LocalTransport:
    """Calls the group PSs' servers in this process (tests, one-process runs)."""

    finish_timeout = None  # (nothing to wait for: post ran the request)

    def __init__(self, servers: Sequence[GroupPsServer], src: int = 0):
        self.servers = list(servers)
        self.count = len(self.servers)
        self.src = src
        self._replies: dict = {}

    def post(self, p: int, msg: tuple) -> None:
        self._replies[p] = self.servers[p].handle(self.src, msg)

    def wait(self, p: int, what: str, timeout: Optional[float] = None):
        return self._replies.pop(p)


class MpiTransport:
    """Requests to the group PSs' ranks over `comm` (tag `tag`, one per trainer
    thread, so that each thread gets its own replies). A reply that does not come
    within `timeout` seconds raises GroupPsTimeout naming the PS's rank; waiting
    for one sleeps between probes (hps.distributed.poll). The answer to "finish"
    may take `finish_timeout`, FINISH_WAITS times `timeout` (see there)."""

    def __init__(self, comm, ps_ranks: Sequence[int], timeout: float = 60.0, tag: int = 1):
        self.comm = comm
        self.ps_ranks = list(ps_ranks)
        self.count = len(self.ps_ranks)
        self.timeout = timeout
        self.finish_timeout = FINISH_WAITS * timeout
        self.tag = tag

    def post(self, p: int, msg: tuple) -> None:
        self.comm.send(msg, dest=self.ps_ranks[p], tag=self.tag)

    def wait(self, p: int, what: str, timeout: Optional[float] = None):
        """PS p's reply, within `timeout` seconds (None: the transport's)."""
        # A PS that hangs is caught here; one whose process dies is ended with the
        # job by the launcher (MPICH's hydra kills every rank at once).
        rank = self.ps_ranks[p]
        bound = self.timeout if timeout is None else timeout
        return poll.recv(self.comm, rank, self.tag, timeout=bound, expired=lambda: GroupPsTimeout(
            f"group PS {p} (rank {rank}) did not answer {what} within {bound:g} s: it died or hung"))


def serve(comm, server: GroupPsServer, trainers: int, idle_timeout: Optional[float] = None) -> None:
    """A group PS's loop: answers requests from any rank until `trainers` ranks have
    sent ("stop",). With `idle_timeout`, no request for that long raises
    GroupPsTimeout (the trainers died or hung). Waiting for a request sleeps
    between probes (hps.distributed.poll), so an idle PS leaves its core to the
    trainers."""
    from mpi4py import MPI
    stopped = 0
    waiting: list = []  # (rank, tag) of step (or finish) requests answered when the group's last trainer asks
    status = MPI.Status()
    while stopped < trainers:
        # Sleeps between probes while idle (a blocking recv would spin a core away
        # from the trainers beside it).
        msg = poll.recv(comm, MPI.ANY_SOURCE, MPI.ANY_TAG, timeout=idle_timeout, status=status,
                        expired=lambda: GroupPsTimeout(f"group PS {server.index}: no request from the trainers "
                                                       f"for {idle_timeout:g} s"))
        src, tag = status.Get_source(), status.Get_tag()
        reply = server.handle(src, msg)
        if reply is DEFER:
            waiting.append((src, tag))
            continue
        comm.send(reply, dest=src, tag=tag)
        if msg[0] in ("step", "finish"):
            for r, t in waiting:
                comm.send(reply, dest=r, tag=t)
            waiting.clear()
        if msg[0] == "stop":
            stopped += 1


# ---------------------------------------------------------------- the trainer


def _answers(replies: list) -> list:
    """The group PSs' replies, every one waited for (none left for a later call to
    take); the first refusal among them (GroupPsServer._unsendable) raised."""
    for r in replies:
        if isinstance(r, DivergedError):
            raise r
    return replies


class _RemoteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, remote):
        call = next(remote.calls)
        ctx.remote, ctx.call = remote, call
        return remote.forward_remote(x.detach(), call, keep=True)

    @staticmethod
    def backward(ctx, dy):
        dx = ctx.remote.backward_remote(dy.contiguous(), ctx.call, ctx.needs_input_grad[0])
        return dx, None, None


class _RemoteSegment(nn.Module):
    """A PS segment as the trainer sees it: sends inputs, gathers outputs."""

    def __init__(self, trainer: "SplitTrainer", seg: Segment, in_width: int, out_width: int):
        super().__init__()
        self.seg = seg
        self.in_width, self.out_width = in_width, out_width
        self.parts = _participants(seg, trainer.plan.group_ps)
        self._trainer = [trainer]  # not a submodule: its parameters are not ours
        self.calls = itertools.count()
        self.stream: tuple = ()  # in the codec streams' keys: a Hogwild net's own
        # Backward must run even when no input needs a gradient: the PSs' weights do.
        self.anchor = torch.zeros(0, requires_grad=True)

    def extra_repr(self) -> str:
        pl = self.seg.placement
        how = "pair" if self.seg.kind == "pair" else pl.split
        return (f"{self.seg.name} (modules {self.seg.start}..{self.seg.stop - 1}) on group PS(s) {self.parts}, "
                f"split {how}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_width:
            raise ValueError(f"{self.seg.name}: input of shape {tuple(x.shape)}, expected (B, "
                             f"{self.in_width})")
        if not torch.is_grad_enabled():  # evaluation: no backward will come
            return self.forward_remote(x.detach(), next(self.calls), keep=False)
        return _RemoteFn.apply(x, self.anchor, self)

    def replica(self, trainer: "SplitTrainer", net: int) -> "_RemoteSegment":
        """This segment for Hogwild net `net` (through `trainer`'s transport): the
        same call counter, so that the PSs' (rank, call, segment) keys of the nets'
        calls never collide, and codec streams of its own."""
        twin = _RemoteSegment(trainer, self.seg, self.in_width, self.out_width)
        twin.calls = self.calls  # itertools.count: next() is one C call, atomic under the GIL
        twin.stream = (net,)
        return twin

    def _refuse(self, xs: np.ndarray, kind: str, what: str, there: str) -> None:
        """DivergedError, before anything is sent, where xs holds a value that is not
        finite or that the bf16 codec would round to an infinity (refuse_unsendable)."""
        spec = self._trainer[0].codecs.spec[kind]
        refuse_unsendable(xs, spec, f"{self.seg.name}: {what}, for group PS(s) {self.parts}",
                          f"[hierarchical] {kind} = {spec!r} carries such values to the group PSs, {there}; "
                          f"nothing was sent")

    def _in_blocks(self):
        P = self._trainer[0].plan.group_ps
        return blocks(self.in_width, P)

    def forward_remote(self, x: torch.Tensor, call: int, keep: bool = True) -> torch.Tensor:
        """keep: the PSs keep the activations for a backward pass (not in evaluation)."""
        t = self._trainer[0]
        horizontal = self.seg.kind == "fc" and self.seg.placement.split == "horizontal"
        xs = x.contiguous().numpy()
        self._refuse(xs, "activations", "its input", "whose weights' gradients and the trainer's output")
        ins = self._in_blocks() if horizontal else None
        for k, p in enumerate(self.parts):
            part = np.ascontiguousarray(xs[:, ins[k][0]:ins[k][1]]) if horizontal else xs
            enc = t.counter.encode(t.codecs.get("activations", ("fwd", *self.stream, self.seg.start, p, part.shape)),
                                   "activations", part)
            t.transport.post(p, ("forward", self.seg.start, call, enc, keep))
        ys = [decode(y) for y in _answers([t.transport.wait(p, f"the forward pass of {self.seg.name}")
                                           for p in self.parts])]
        if self.seg.kind == "fc" and self.seg.placement.split == "vertical":
            y = np.concatenate(ys, axis=1)
        else:
            y = ys[0].copy()
            for part in ys[1:]:
                y += part
        return torch.from_numpy(np.ascontiguousarray(y))

    def backward_remote(self, dy: torch.Tensor, call: int, want_dx: bool) -> Optional[torch.Tensor]:
        t = self._trainer[0]
        vertical = self.seg.kind == "fc" and self.seg.placement.split == "vertical"
        dys = dy.numpy()
        self._refuse(dys, "gradients", "the gradient of its output", "whose weights step with them")
        outs = blocks(self.out_width, t.plan.group_ps) if vertical else None
        for k, p in enumerate(self.parts):
            part = np.ascontiguousarray(dys[:, outs[k][0]:outs[k][1]]) if vertical else dys
            # One stream a shape (a top-k of activations or gradients keeps no residual).
            enc = t.counter.encode(t.codecs.get("gradients", ("bwd", *self.stream, self.seg.start, p, part.shape)),
                                   "gradients", part)
            t.transport.post(p, ("backward", self.seg.start, call, enc, want_dx))
        dxs = _answers([t.transport.wait(p, f"the backward pass of {self.seg.name}") for p in self.parts])
        if not want_dx:
            return None
        dxs = [decode(d) for d in dxs]
        if self.seg.kind == "fc" and self.seg.placement.split == "horizontal":
            dx = np.concatenate(dxs, axis=1)
        else:
            dx = dxs[0].copy()
            for part in dxs[1:]:
                dx += part
        return torch.from_numpy(np.ascontiguousarray(dx))


class SplitTrainer(nn.Module):
    """The trainer's side of a split Sequential: its own layers, and one remote
    segment per PS-held layer or pair. ``parameters()`` are the trainer's only;
    after the optimizer's step call :meth:`ps_step` so the PSs take theirs.

    Shapes: input (B, in_features) -> output (B, out_features), as the Sequential."""

    def __init__(self, seq: nn.Sequential, plan: SplitPlan, transport, codecs: Optional[CodecStreams] = None,
                 counter: Optional[ByteCounter] = None):
        super().__init__()
        self.plan = plan
        self.transport = transport
        self.codecs = codecs or CodecStreams()
        self.counter = counter or ByteCounter()
        self.segments = segments(seq, plan)
        if any(s.kind != "local" for s in self.segments) and transport.count != plan.group_ps:
            raise ValueError(f"SplitTrainer: the plan splits over {plan.group_ps} group PSs, the transport reaches "
                             f"{transport.count}")
        mods: list = []
        for s in self.segments:
            if s.kind == "local":
                mods += [copy.deepcopy(seq[k]) for k in range(s.start, s.stop)]
            else:
                mods.append(_RemoteSegment(self, s, seq[s.fcs[0]].in_features, seq[s.fcs[-1]].out_features))
        self.net = nn.Sequential(*mods)
        self._origin = [(s, k) for s in self.segments for k in (range(s.start, s.stop) if s.kind == "local"
                                                                  else [None])]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def replica(self, transport, net: int) -> "SplitTrainer":
        """Hogwild net `net`'s view of this trainer: its local layers' parameters are
        new tensors over this one's memory (each net has its own .grad, and its own
        autograd version counter, so one net's in-place step does not fail another's
        backward), its remote segments reach the same PSs through `transport` (a tag
        of its own, so each net gets its own replies). Counts bytes in this trainer's
        counter (thread-safe). Steps of the PSs and stop stay with this trainer."""
        twin = SplitTrainer.__new__(SplitTrainer)
        nn.Module.__init__(twin)
        twin.plan, twin.transport, twin.codecs, twin.counter = self.plan, transport, self.codecs, self.counter
        twin.segments, twin._origin = self.segments, self._origin
        twin.net = nn.Sequential(*[m.replica(twin, net) if isinstance(m, _RemoteSegment) else shared_copy(m)
                                   for m in self.net])
        return twin

    def _all_ps(self) -> list:
        # Every group PS the transport reaches (one the plan leaves idle still steps and stops).
        return list(range(self.transport.count))

    def ps_step(self) -> None:
        """Every group PS applies its optimizer to the gradients it gathered."""
        for p in self._all_ps():
            self.transport.post(p, ("step",))
        for p in self._all_ps():
            self.transport.wait(p, "the optimizer step")

    def ps_finish(self) -> None:
        """After the last step: every group PS lands its last averaging (its
        on_finish) before this returns, so that an evaluation after it sees the
        blocks the job ends with. Waits the transport's ``finish_timeout``: the
        last averaging may wait on the centre twice (FINISH_WAITS)."""
        for p in self._all_ps():
            self.transport.post(p, ("finish",))
        for p in self._all_ps():
            self.transport.wait(p, f"the end of training (its last averaging, allowed {FINISH_WAITS} x the timeout)",
                                timeout=self.transport.finish_timeout)

    def ps_save(self) -> list:
        """Every group PS's state_dict (torch.save's bytes), in PS order, at a step
        boundary (for the checkpoint its group's first trainer writes)."""
        for p in self._all_ps():
            self.transport.post(p, ("save",))
        return [self.transport.wait(p, "the state of its blocks for a checkpoint",
                                    timeout=self.transport.finish_timeout) for p in self._all_ps()]

    def stop(self) -> None:
        for p in self._all_ps():
            self.transport.post(p, ("stop",))
        for p in self._all_ps():
            self.transport.wait(p, "stop")

    def full_state(self) -> dict:
        """The whole Sequential's {"<layer>.weight"/"<layer>.bias": (value, grad)},
        the PSs' blocks fetched and put back together (for checks and checkpoints)."""
        for p in self._all_ps():
            self.transport.post(p, ("state",))
        shards = [self.transport.wait(p, "the state of its blocks") for p in self._all_ps()]
        return assemble_state(self, shards)


def shared_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` whose parameters are new Parameters over the same memory
    (torch.from_numpy of each one's data): a write through either is seen by the
    other, but each has its own .grad and its own version counter (views made by
    torch, detach() included, share the counter, and a Hogwild net's in-place
    optimizer step would then fail another net's backward with "modified by an
    inplace operation"). CPU float32 parameters only (the trainer's)."""
    twin = copy.deepcopy(module)
    for (name, p), sub in zip(module.named_modules(), twin.modules()):
        for pname, param in p.named_parameters(recurse=False):
            if param.device.type != "cpu" or param.dtype != torch.float32:
                raise TypeError(f"shared_copy: parameter {name + '.' if name else ''}{pname} is {param.dtype} on "
                                f"{param.device}; Hogwild nets share CPU float32 parameters")
            setattr(sub, pname, nn.Parameter(torch.from_numpy(param.detach().numpy())))
    return twin


def assemble_state(trainer: SplitTrainer, shards: Sequence[dict]) -> dict:
    """Puts the trainer's layers and the PSs' blocks (GroupPsServer "state"
    replies) back into the unsplit Sequential's names."""
    out: dict = {}

    def put(name, value, grad):
        out[name] = (value, grad)

    for mod, (seg, k) in zip(trainer.net, trainer._origin):
        if seg.kind == "local":
            for n, p in mod.named_parameters():
                put(f"{k}.{n}", p.detach().numpy().copy(), None if p.grad is None else p.grad.numpy().copy())
    P = trainer.plan.group_ps
    for seg in trainer.segments:
        if seg.kind == "local":
            continue
        parts = _participants(seg, P)
        pl = seg.placement

        def cat(name, axis, who=parts):
            vals = [shards[p][f"{seg.start}.{name}"] for p in who]
            grads = [g for _, g in vals]
            return (np.concatenate([v for v, _ in vals], axis=axis),
                    None if any(g is None for g in grads) else np.concatenate(grads, axis=axis))

        if seg.kind == "fc" and pl.split == "none":
            (p,) = parts
            for n in ("weight", "bias"):
                if f"{seg.start}.0.{n}" in shards[p]:
                    put(f"{seg.start}.{n}", *shards[p][f"{seg.start}.0.{n}"])
        elif seg.kind == "fc" and pl.split == "vertical":
            put(f"{seg.start}.weight", *cat("0.weight", 0))
            if f"{seg.start}.0.bias" in shards[0]:
                put(f"{seg.start}.bias", *cat("0.bias", 0))
        elif seg.kind == "fc":
            put(f"{seg.start}.weight", *cat("0.weight", 1))
            if f"{seg.start}.0.bias" in shards[0]:
                put(f"{seg.start}.bias", *shards[0][f"{seg.start}.0.bias"])
        else:
            last = seg.fcs[1] - seg.fcs[0]
            put(f"{seg.fcs[0]}.weight", *cat("0.weight", 0))
            if f"{seg.start}.0.bias" in shards[0]:
                put(f"{seg.fcs[0]}.bias", *cat("0.bias", 0))
            put(f"{seg.fcs[1]}.weight", *cat(f"{last}.weight", 1))
            if f"{seg.start}.{last}.bias" in shards[0]:
                put(f"{seg.fcs[1]}.bias", *shards[0][f"{seg.start}.{last}.bias"])
    return out
