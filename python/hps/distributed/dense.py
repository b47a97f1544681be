"""The dense (torch) parameters kept in step over the ranks: gradients all-reduced
every step, or k-step Adam (the terabyte-scale paper's Algorithm 2). torch is
imported on first use, so that the package imports without it.
"""
from __future__ import annotations

import functools
import math
from typing import NoReturn, Optional, Sequence

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


# k-step Adam's v is a running mean of squared gradients, b2 v + (1 - b2) g^2: a
# gradient past the square root of the dtype's largest value (float32's: |g| past
# 1.8e19) made g^2, and with it v, an infinity, after which m / sqrt(v) is 0 (the
# parameter never moves again) or NaN, and the checkpoint kept it so. A step is
# refused where a gradient tensor's sum of squares passes the largest value / 2^8
# (float32: 1.3e36; so is any |g| past 1.15e18). The sum is at least each of its
# squares, so every square that reaches v is under that bound, and v, a mean of eps
# and such squares (the merge's too: a mean of the ranks' v), stays under it but for
# rounding: each step's few roundings add a few parts in 2^24 / (1 - b2) at most,
# which the 2^8 of headroom covers for any beta2 that float32 holds apart from 1, as
# it covers the merge's float32 sum of the ranks' v for most jobs (a sum that
# overflows there is refused, on every rank alike). m, a mean of 0 and such
# gradients (b1 m + (1 - b1) g), cannot overflow either; the step lr m / sqrt(v) is
# at most lr / sqrt(1 - b2) for b1 = 0 (v >= (1 - b2) g^2). A NaN or an infinity in
# a gradient makes its sum one, refused too. The sum is one BLAS dot product a
# tensor, one read of the gradients: on W4's MLP (429-512-256-1, 2 cores) 35 us with
# the gradients out of cache, +10% to +16% of the step; the largest |g| took 1.5 to
# 2 times as long (torch.aminmax, amax of abs), 12 to 20 times by
# torch._foreach_norm(ord=inf), and a check of every parameter, m and v after the
# step cost +70%. On a GPU the step waits for the sums (one copy to the host).
_SQUARES_HEADROOM = 2.0 ** 8
_SQUARES_LIMIT: dict = {}  # dtype: the largest sum of squares of one of its gradient tensors that a step takes


def _refuse_overflowing_gradients(param_groups, torch) -> None:
    """Raises DivergedError, before any parameter, m or v changes (all or nothing),
    where a gradient's sum of squares passes the dtype's largest value / 2^8 or is
    not a number: its squares in v could overflow (see above). For a dtype of less
    range than float32's (float16: its sum of squares passes 65504 long before a
    square does) the largest square stands for the sum. Names the dense parameter
    (its place among all of the optimizer's, its shape) and its largest |gradient|.
    Each rank decides on its own gradients (k-step Adam's are not all-reduced, and
    a decision of every rank alike would cost an exchange a step, which k-step Adam
    exists to save): under hps train a rank that raises ends the job, every rank,
    as a loss that is not a number does, before a merge or checkpoint (collectives)
    can hold its step."""
    params, sums = [], []
    for group in param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.dtype == torch.float32 or g.dtype == torch.float64:
                f = g if g.dim() == 1 else g.reshape(-1)
                sums.append(torch.dot(f, f))
            else:
                sums.append(g.abs().amax().float().square())
            params.append(p)
    if not params:
        return
    if not sums[0].is_cpu and len({(s.device, s.dtype) for s in sums}) == 1:
        said = torch.stack(sums).tolist()  # (one wait for the device, not one a tensor)
    else:
        said = [s.item() for s in sums]
    for p, s in zip(params, said):
        limit = _SQUARES_LIMIT.get(p.dtype)
        if limit is None:
            limit = _SQUARES_LIMIT[p.dtype] = float(torch.finfo(p.dtype).max) / _SQUARES_HEADROOM
        if not s <= limit:  # (a NaN too)
            _refuse_gradient(param_groups, p, s, limit, torch)


def _refuse_gradient(param_groups, p, s: float, limit: float, torch) -> NoReturn:
    """_refuse_overflowing_gradients's error, for parameter p, its gradient's sum of squares s."""
    from hps.errors import DivergedError
    params = [q for group in param_groups for q in group["params"]]
    i = next(i for i, q in enumerate(params) if q is p)
    g = p.grad
    bad = ~torch.isfinite(g)
    if bool(bad.any()):
        why = f"a non-finite gradient (first: {float(g[bad].reshape(-1)[0])!s})"
    else:
        why = (f"gradients whose sum of squares is {s:.4g} (largest |gradient| {float(g.abs().max()):.4g}), past "
               f"{limit:.4g}: their squares in v could overflow {p.dtype}")
    raise DivergedError(f"k-step Adam step: dense parameter {i} of {len(params)} (shape {tuple(p.shape)}) has "
                        f"{why}: training diverged; no dense parameter was changed")


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
        A step whose gradients' squares could overflow v (a gradient tensor's sum of
        squares past the dtype's largest value / 2^8: float32's 1.3e36), or that
        holds a NaN or an infinity, raises DivergedError before any parameter
        changes (_refuse_overflowing_gradients). Every k steps DenseSync averages x
        and v over the ranks; m stays local."""

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
            _refuse_overflowing_gradients(self.param_groups, torch)  # (before any parameter, m or v changes)
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
