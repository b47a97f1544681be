"""Sparse optimizer and initializer settings for embedding tables.

Each optimizer keeps its state in the row after the embedding, and its update
is fused into the native row update (one step per distinct key per push, with
the gradients of duplicate keys summed first). The formulas follow torch.optim:

- SGD:            w -= lr * g
- AdaGrad:        h += g*g;             w -= lr * g / (sqrt(h) + eps)
- RowWiseAdaGrad: h += mean(g*g);       w -= lr * g / (sqrt(h) + eps)   (one h per row)
- Adam:           t += 1; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
                  w -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
  with t counted per row, so bias correction follows that row's own updates.

A new row is initialised as a pure function of (seed, key).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Union

from hps import _core


@dataclass(frozen=True)
class SGD:
    lr: float = 0.01
    kind = "sgd"

    def _native_args(self) -> dict:
        return {"lr": self.lr}


@dataclass(frozen=True)
class AdaGrad:
    lr: float = 0.01
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    kind = "adagrad"

    def _native_args(self) -> dict:
        return {"lr": self.lr, "eps": self.eps, "initial_accumulator": self.initial_accumulator_value}


@dataclass(frozen=True)
class RowWiseAdaGrad(AdaGrad):
    kind = "rowwise_adagrad"


@dataclass(frozen=True)
class Adam:
    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    kind = "adam"

    def _native_args(self) -> dict:
        return {"lr": self.lr, "beta1": self.beta1, "beta2": self.beta2, "eps": self.eps}


@dataclass(frozen=True)
class Uniform:
    """Values drawn from [-scale, scale)."""
    scale: float = 0.01
    kind = "uniform"


@dataclass(frozen=True)
class Normal:
    """Values drawn from N(0, std^2)."""
    std: float = 0.01
    kind = "normal"

    @property
    def scale(self) -> float:
        return self.std


@dataclass(frozen=True)
class Zeros:
    kind = "zeros"
    scale = 0.0


Optimizer = Union[SGD, AdaGrad, RowWiseAdaGrad, Adam]
Initializer = Union[Uniform, Normal, Zeros]


def native_optimizer(dim: int, optimizer: Optimizer, initializer: Initializer,
                     seed: int) -> _core.SparseOptimizer:
    """The native, validated form of (dim, optimizer, initializer, seed)."""
    if not isinstance(optimizer, (SGD, AdaGrad, Adam)):
        raise TypeError(f"optimizer must be hps.SGD, AdaGrad, RowWiseAdaGrad or Adam, got {optimizer!r}")
    if not isinstance(initializer, (Uniform, Normal, Zeros)):
        raise TypeError(f"initializer must be hps.Uniform, Normal or Zeros, got {initializer!r}")
    # Types here, ranges in the native check: a string or a negative seed would
    # otherwise reach the binding and come back as its list of overloads.
    for name, value in [*optimizer._native_args().items(), ("initializer scale", initializer.scale)]:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"optimizer: {name} must be a number, got {value!r}")
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or not 0 < dim < 1 << 31:
        raise ValueError(f"optimizer: dim must be > 0 and below 2**31, got {dim!r}")  # (the native bound is lower)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an integer from 0 to 2**64 - 1, got {seed!r}")
    return _core.SparseOptimizer(dim=dim, kind=optimizer.kind, init=initializer.kind,
                                 init_scale=initializer.scale, seed=seed,
                                 **optimizer._native_args())
