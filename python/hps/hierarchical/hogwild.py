"""Hogwild nets (HT, section 4.1; Recht et al., 2011): R threads of one trainer
train one shared copy of its dense parameters, without locks.

Per batch, :meth:`HogwildNets.step` (it takes hps.train.Trainer.step's place):

1. The MLP's input is made once for the whole batch, as CtrModel makes it (the
   embedding rows gathered, the dense features appended), by a tap standing in
   for the MLP; its rows are cut into R contiguous slices, one a net (a slice may
   be empty when the batch has fewer than R examples).
2. R threads run at once, thread r on slice r: forward and backward through net
   r's replica of the dense model, the loss normalised as Trainer.step's (by the
   examples of the global batch), then net r's own optimizer (its own Adam state)
   steps, in place, on the shared parameters. The replicas' parameter tensors are
   new tensors over one memory (hps.hierarchical.split_mlp.shared_copy): a step
   by one net is seen by the others at once, nothing is locked, and a forward may
   read weights another net is writing (Hogwild's race, accepted by design).
   With T > 1 trainers in the group, net r's gradients are first all-reduced with
   net r of the group's other trainers (a communicator a net), so each net steps
   on the group's gradient of its slices as the synchronous trainer does.
3. The slices' input gradients are put back together and pushed into the
   embedding once (sparse stays bulk-synchronous per batch); then, with T > 1,
   trainer 0's copy is broadcast to the group (the nets' steps interleave
   differently on each trainer, so their copies differ in rounding and lost
   updates; the broadcast makes them one replica again at every step boundary,
   where GroupAverage lands the averaging corrections), and the dense sync's
   after_step runs as after a synchronous step (group PSs step, averaging).

Layers on group PSs are not Hogwild: the PS serves the nets' requests one at a
time (one serve loop) and steps once a batch on the sum of every net's and every
trainer's gradients, as with one net, so its weights do not change during a batch.
Each net reaches the PSs through its own MPI tag and codec streams.

R = 1 does not come here: hps.hierarchical.roles keeps Trainer.step (bit for bit
today's training); this module with nets = 1 computes the same numbers (a test
holds it to that).
"""
from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from hps.hierarchical.easgd import allreduce_within, bcast_within
from hps.hierarchical.split_mlp import SplitTrainer, shared_copy

__all__ = ["HogwildNets", "HogwildOptimizers", "install"]


class _InputTap(nn.Module):
    """Stands in for CtrModel's MLP for one forward: keeps the MLP's input and
    returns its first column (so that CtrModel's squeeze works); the output is
    not used."""

    def __init__(self):
        super().__init__()
        self.x: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.x = x
        return x[:, :1]


class HogwildOptimizers:
    """The trainer's ``opt`` while Hogwild nets train: one optimizer a net, saved
    and loaded together (a checkpoint keeps every net's state)."""

    def __init__(self, optimizers: Sequence):
        self.optimizers = list(optimizers)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        raise RuntimeError("Hogwild nets step their own optimizers, each in its thread (HogwildNets.step)")

    def state_dict(self) -> dict:
        return {"nets": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        nets = state.get("nets")
        if not isinstance(nets, list) or len(nets) != len(self.optimizers):
            raise ValueError(f"the checkpoint's dense optimizer state holds "
                             f"{len(nets) if isinstance(nets, list) else 'no'} Hogwild net(s), this run has "
                             f"{len(self.optimizers)} ([hierarchical] nets)")
        for o, s in zip(self.optimizers, nets):
            o.load_state_dict(s)


class HogwildNets:
    """R nets over one dense copy for one trainer (see the module's docstring).

    ``model``: the trainer's dense model (an nn.Sequential, or a SplitTrainer whose
    PS segments then reach the group PSs through ``transport_for(r)``, one
    transport a net). Its parameters must already lie in one flat float32 memory,
    ``live`` (hps.hierarchical.roles._flatten), which the nets share.
    ``make_optimizer(params)``: a net's optimizer. ``group_comms``: with T > 1
    trainers in the group, one communicator a net over the group's trainers (net
    r all-reduces its gradients over the r-th); ``group_comm``: the group's, for
    the broadcast that keeps its trainers' copies one replica. ``timeout``: seconds
    a net's all-reduce, or that broadcast, waits for the other trainers (None: for
    ever), past which the step raises AllreduceTimeout naming the net (or
    BroadcastTimeout) and ``group_ranks`` (the group's trainers as the job numbers
    them)."""

    def __init__(self, model: nn.Module, live: np.ndarray, nets: int, make_optimizer: Callable, *,
                 transport_for: Optional[Callable] = None, group_comms: Optional[Sequence] = None,
                 group_comm=None, timeout: Optional[float] = None, group_ranks: Optional[Sequence[int]] = None):
        if not (isinstance(nets, int) and not isinstance(nets, bool) and nets >= 1):
            raise ValueError(f"[hierarchical] nets must be an int >= 1, got {nets!r}")
        self.model, self.live, self.R = model, live, nets
        if isinstance(model, SplitTrainer):
            if transport_for is None:
                raise ValueError("HogwildNets: a SplitTrainer's nets need transport_for (a transport a net)")
            self.nets = [model.replica(transport_for(r), r) for r in range(nets)]
        else:
            self.nets = [shared_copy(model) for _ in range(nets)]
        self.params = [list(n.parameters()) for n in self.nets]
        for ps in self.params:
            for p in ps:
                if p.numel() and not _inside(p, live):
                    raise ValueError("HogwildNets: the model's parameters must lie in `live` (flatten them first)")
        self.optimizers = [make_optimizer(ps) if ps else None for ps in self.params]
        self.group_comms = list(group_comms) if group_comms is not None else None
        if self.group_comms is not None and len(self.group_comms) != nets:
            raise ValueError(f"HogwildNets: {len(self.group_comms)} group communicators for {nets} nets")
        self.group_comm = group_comm
        self.timeout, self.group_ranks = timeout, group_ranks
        self.examples = [0] * nets      # examples each net trained (its slices' rows)
        self.steps = 0                  # batches (each net steps once a batch)
        self._pool = ThreadPoolExecutor(max_workers=nets, thread_name_prefix="hps-hogwild")
        self._tap = _InputTap()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    @contextlib.contextmanager
    def _tapped(self, model):
        mlp = model.mlp
        model.mlp = self._tap
        try:
            yield self._tap
        finally:
            model.mlp = mlp
            self._tap.x = None

    def _net_step(self, r: int, pieces: list, n: int, loss_fn, trainer):
        """Thread r: forward and backward of its slice, a piece a model call of
        Trainer.step it meets (with one net, the same sums in the same order), the
        group's all-reduce of its gradients (T > 1), then its optimizer's step on
        the shared memory. Returns each piece's input gradient and logits. A loss
        that is not a number raises DivergedError before its backward pass, as
        Trainer.step does (the nets that stepped meanwhile stepped on numbers; the
        batch's embedding gradients are pushed only once every net has returned)."""
        from hps.train import _diverged
        net, params, opt = self.nets[r], self.params[r], self.optimizers[r]
        for p in params:
            p.grad = None
        out = []
        for x, labels, worker in pieces:
            x = x.detach().requires_grad_(True)  # a leaf of this thread's own graph
            logits = net(x).squeeze(1)
            loss = loss_fn(logits, labels) / n
            if not torch.isfinite(loss):
                raise _diverged(trainer, loss.item(), f"worker {worker}, Hogwild net {r}")
            loss.backward()
            out.append((x.grad, logits.detach()))
        if self.group_comms is not None and params:
            buf = np.concatenate([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).numpy()
                                  for p in params])
            allreduce_within(self.group_comms[r], buf, self.timeout, f"Hogwild net {r}'s gradients",
                             self.group_ranks)
            at = 0
            for p in params:
                p.grad = torch.from_numpy(buf[at:at + p.numel()]).view_as(p)
                at += p.numel()
        if opt is not None:
            opt.step()
        return out

    def step(self, trainer, loaded) -> None:
        """One batch (hps.train.Trainer.step's contract: the embedding gradients
        reach the batch, the dense parameters take their step, dense_sync's
        after_step runs)."""
        examples = loaded.data
        n = max(getattr(examples, "total_examples", len(examples.labels)), 1)
        emb = trainer.model.embedding
        xs, rows, workers = [], [], []
        with self._tapped(trainer.model) as tap:
            for worker, idx, batch in trainer._calls(loaded, examples):  # (Trainer.step's model calls)
                emb.attach(batch, worker)
                keys = torch.from_numpy(examples.keys[idx].view(np.int64))
                if getattr(examples, "bags", None):
                    from hps.train import _bag_inputs
                    trainer.model(keys, torch.from_numpy(examples.dense[idx]), _bag_inputs(examples.rows(idx)))
                else:
                    trainer.model(keys, torch.from_numpy(examples.dense[idx]))
                xs.append(tap.x)
                rows.append(idx)
                workers.append(worker)
        # The batch's rows (mini-batch after mini-batch) cut into R contiguous slices;
        # a slice is a piece a mini-batch it meets. (A net with an empty slice still
        # runs: with T > 1 its all-reduce needs it, and it steps on the group's sum.)
        total = sum(len(i) for i in rows)
        cuts = [total * r // self.R for r in range(self.R + 1)]
        starts = np.cumsum([0] + [len(i) for i in rows])
        labels = [torch.from_numpy(np.ascontiguousarray(examples.labels[i])) for i in rows]
        plan = [[(k, max(cuts[r], starts[k]) - starts[k], min(cuts[r + 1], starts[k + 1]) - starts[k])
                 for k in range(len(rows)) if max(cuts[r], starts[k]) < min(cuts[r + 1], starts[k + 1])]
                for r in range(self.R)]
        futures = [self._pool.submit(self._net_step, r, [(xs[k].detach()[lo:hi], labels[k][lo:hi], workers[k])
                                                         for k, lo, hi in plan[r]], n, trainer.loss_fn, trainer)
                   for r in range(self.R)]
        results = [f.result() for f in futures]  # re-raises a net's error here
        for r in range(self.R):
            self.examples[r] += cuts[r + 1] - cuts[r]
        dxs: list = [[] for _ in rows]
        logits: list = [[] for _ in rows]
        for r in range(self.R):
            for (k, lo, hi), (dx, lg) in zip(plan[r], results[r]):
                dxs[k].append(dx)
                logits[k].append(lg)
        grads = [torch.cat(d) if len(d) > 1 else d[0] for d in dxs]
        for x, g in zip(xs, grads):  # the embedding gradients, once for the batch, mini-batch after mini-batch
            if x.requires_grad:      # (Trainer.step's order: a key in two of them sums the same way)
                x.backward(g)
        emb.attach(None)
        if trainer.step_logits is not None:
            for idx, lg in zip(rows, logits):
                trainer.step_logits.append((idx, (torch.cat(lg) if len(lg) > 1 else lg[0]).numpy()))
        self._share_replica()
        self.steps += 1
        if trainer.dense_sync is not None:
            trainer.dense_sync.after_step()

    def _share_replica(self) -> None:
        """The group's trainer 0's replica, broadcast to the group's other trainers:
        their copies stay one replica."""
        if self.group_comm is not None and self.group_comm.Get_size() > 1 and self.live.size:
            bcast_within(self.group_comm, self.live, 0, self.timeout, "the Hogwild nets' replica", self.group_ranks)


def _inside(p: torch.Tensor, live: np.ndarray) -> bool:
    a = p.detach().numpy()
    lo = live.__array_interface__["data"][0]
    at = a.__array_interface__["data"][0]
    return lo <= at and at + a.nbytes <= lo + live.nbytes


def install(trainer, nets: int, make_optimizer: Callable, live: np.ndarray, **kw) -> HogwildNets:
    """Puts R Hogwild nets in `trainer` (an hps.train.Trainer, after dense_hook made
    its dense model and sync): its ``step`` becomes HogwildNets.step and its ``opt``
    the nets' optimizers. `live`: the flat memory of trainer.model.mlp's parameters.
    Returns the nets (close() them after training)."""
    hog = HogwildNets(trainer.model.mlp, live, nets, make_optimizer, **kw)
    trainer.opt = HogwildOptimizers([o for o in hog.optimizers if o is not None])
    trainer.step = lambda loaded: hog.step(trainer, loaded)  # the instance's, in Trainer.step's place
    return hog
