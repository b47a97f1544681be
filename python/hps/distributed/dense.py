"""The dense (torch) parameters kept in step over the ranks: gradients all-reduced
every step, or k-step Adam (the terabyte-scale paper's Algorithm 2). torch is
imported on first use, so that the package imports without it.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import numpy as np

from hps.distributed.comm import DistributedConfig, Node

def _flat(tensors) -> np.ndarray:
    """The tensors' values as one float32 array in host memory, MPI's buffer, from
    wherever they lie: a model on a GPU (model_devices = "cuda"), or of a dtype
    numpy has none of (bfloat16), is one .numpy() refuses."""
    import torch
    return np.concatenate([t.detach().reshape(-1).to("cpu", torch.float32).numpy() for t in tensors])


def _refuse_nonfinite(flat: np.ndarray, tensors, what: str, v_from: Optional[int] = None) -> None:
    """Raises DivergedError where the all-reduced `flat` (the tensors' values, in
    order) holds a NaN or an infinity, naming `what`, how many values, and the
    first one's tensor: dense parameter i (its place among them) and its shape,
    or from tensor `v_from` on, k-step Adam's v of parameter i - v_from. Finite
    values of the ranks can overflow in their sum; every rank holds the same sum,
    so every rank raises alike, before any tensor is written."""
    ok = np.isfinite(flat)
    if ok.all():
        return
    from hps.errors import DivergedError
    first = int(np.argmin(ok))
    i = int(np.searchsorted(np.cumsum([t.numel() for t in tensors]), first, side="right"))
    n = len(tensors) if v_from is None else v_from
    which = f"dense parameter {i} of {n}" if i < n else f"k-step Adam's v of dense parameter {i - n} of {n}"
    bad = int(ok.size - np.count_nonzero(ok))
    raise DivergedError(f"{what}: {bad} non-finite value{'s' if bad != 1 else ''} summed over the ranks ({which}, "
                        f"shape {tuple(tensors[i].shape)}, first: {flat[first]!s}): training diverged (finite "
                        f"values of the ranks can overflow in their sum); no dense parameter was changed")


def _unflat(flat: np.ndarray, tensors) -> None:
    """flat's values back into the tensors, on their devices, in their dtypes (copy_)."""
    import torch
    at = 0
    for t in tensors:
        n = t.numel()
        t.copy_(torch.from_numpy(flat[at:at + n]).reshape(t.shape))
        at += n


@functools.lru_cache(maxsize=None)
def kstep_adam_class():
    """KStepAdam (a torch.optim.Optimizer; made on first use so that the core
    does not import torch)."""
    import torch

    class KStepAdam(torch.optim.Optimizer):
        """The local step of k-step Adam (the terabyte-scale paper's Algorithm 2):

            m <- beta1 m + (1 - beta1) g;   v <- beta2 v + (1 - beta2) g^2;
            x <- x - lr m / sqrt(v)

        with m = 0 and v = eps to start, no bias correction and no eps in the
        denominator: v > 0 keeps it finite, so v is kept at least the dtype's
        smallest normal value. A parameter whose gradient stays 0 (a dead ReLU
        unit's weights) saw v decay to 0 (beta2 <= 0.5 after a few dozen steps,
        any beta2 where denormals are flushed) and m / sqrt(v) = 0 / 0 made it NaN.
        Every k steps DenseSync averages x and v over the ranks; m stays local."""

        def __init__(self, params, lr: float = 1e-3, beta1: float = 0.0, beta2: float = 0.999,
                     eps: float = 1e-8):
            # As [distributed] checks them (a direct use went on with a negative lr or
            # a beta of 1 or more: steps uphill, or a v that grows without bound).
            def number(v) -> bool:
                return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not (number(lr) and lr >= 0):
                raise ValueError(f"KStepAdam: lr must be a finite number >= 0, got {lr!r}")
            for name, b in (("beta1", beta1), ("beta2", beta2)):
                if not (number(b) and 0.0 <= b < 1.0):
                    raise ValueError(f"KStepAdam: {name} must be in [0, 1), got {b!r}")
            if not (number(eps) and eps > 0):
                raise ValueError(f"KStepAdam: eps must be a finite number > 0, got {eps!r}")
            super().__init__(params, {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                lr, b1, b2, eps = group["lr"], group["beta1"], group["beta2"], group["eps"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if not st:
                        st["m"] = torch.zeros_like(p)
                        st["v"] = torch.full_like(p, eps)
                    g = p.grad
                    st["m"].mul_(b1).add_(g, alpha=1 - b1)
                    st["v"].mul_(b2).addcmul_(g, g, value=1 - b2).clamp_min_(torch.finfo(p.dtype).tiny)
                    p.addcdiv_(st["m"], st["v"].sqrt(), value=-lr)

        def second_moments(self) -> list:
            out = []
            for group in self.param_groups:
                for p in group["params"]:
                    st = self.state[p]
                    if not st:
                        st["m"] = torch.zeros_like(p)
                        st["v"] = torch.full_like(p, group["eps"])
                    out.append(st["v"])
            return out

    return KStepAdam


def __getattr__(name: str):
    if name == "KStepAdam":
        return kstep_adam_class()
    raise AttributeError(f"module 'hps.distributed.dense' has no attribute {name!r}")


class DenseSync:
    """Keeps the dense (torch) parameters of the ranks in step.

    ``allreduce``: call reduce_gradients() after backward, before the optimizer
    step: every rank sums the gradients and takes the same step.
    ``kstep``: use make_optimizer()'s KStepAdam and call after_step() after each
    step: every k steps x and v are averaged over the ranks."""

    def __init__(self, node: Node, params: Sequence, lr: float, config: Optional[DistributedConfig] = None):
        self.node = node
        self.config = config or node.config
        self.params = list(params)
        self.lr = lr
        self.steps = 0
        self.merges = 0
        self.optimizer = None

    def make_optimizer(self, default_factory):
        if self.config.dense_sync == "kstep":
            c = self.config
            self.optimizer = kstep_adam_class()(self.params, lr=self.lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps)
        else:
            self.optimizer = default_factory(self.params)
        return self.optimizer

    def broadcast_parameters(self) -> None:
        """Rank 0's parameters to every rank (so all start from one model)."""
        import torch
        flat = _flat(self.params)
        with self.node.guard("broadcast of the dense parameters"):
            self.node.comms["train"].Bcast(flat, root=0)
        with torch.no_grad():
            _unflat(flat, self.params)

    def reduce_gradients(self) -> None:
        import torch
        if self.config.dense_sync != "allreduce" or self.node.size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = _flat(grads)
        self.node.allreduce("train", flat, "dense", "dense gradient all-reduce", self.config.hierarchical)
        _refuse_nonfinite(flat, self.params, "dense gradient all-reduce")  # before the optimizer can step them
        for p, g in zip(self.params, grads):
            p.grad = g
        with torch.no_grad():
            _unflat(flat, [p.grad for p in self.params])

    def after_step(self, final: bool = False) -> None:
        """Counts a step; every k steps (and at the end, `final`) averages x and v."""
        if self.config.dense_sync != "kstep":
            return
        if not final:
            self.steps += 1
            if self.steps % self.config.k:
                return
        elif self.steps % self.config.k == 0:
            return  # the last step merged already
        self.merge()

    def merge(self) -> None:
        import torch
        vs = self.optimizer.second_moments()
        flat = np.concatenate([_flat(self.params), _flat(vs)])
        self.node.allreduce("train", flat, "dense", "k-step Adam merge", self.config.hierarchical)
        flat /= self.node.size
        _refuse_nonfinite(flat, self.params + vs, "k-step Adam merge", v_from=len(self.params))
        n = sum(p.numel() for p in self.params)
        with torch.no_grad():
            _unflat(flat[:n], self.params)
            _unflat(flat[n:], vs)
        self.merges += 1

    def state_dict(self) -> dict:
        return {"steps": self.steps, "merges": self.merges}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.merges = state["steps"], state["merges"]
