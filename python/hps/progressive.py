"""Progressive validation (online training): each batch is scored by the model
before the model trains on it, and AUC and logloss are taken over a sliding
window of the latest scored examples.

Since no example is scored after the model has seen it, the windowed metrics
measure generalisation on a stream without a held-out set (the way the
terabyte-scale CTR papers evaluate). hps.train scores a batch with the logits
of the training step's own forward pass, which runs before that step's update.

>>> w = ProgressiveWindow(examples=4)
>>> w.add(np.array([0., 1.]), np.array([0.2, 0.9]))
>>> w.add(np.array([1., 0., 0.]), np.array([0.3, 0.4, 0.1]))
>>> w.size, round(w.metrics()["auc"], 4)   # the last 4 examples: labels 1,1,0,0
(4, 0.75)
"""
from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np

from hps.metrics import auc, logloss


class ProgressiveWindow:
    """The latest ``examples`` scored examples (or those of the latest ``batches``
    batches, when given; an empty batch is none). ``add`` one batch's labels and probabilities; ``metrics``
    gives AUC and logloss over the window, and the counts; ``record``, called once a
    batch, keeps the curve in ``history`` at most ``max_points`` long: every
    ``stride``-th batch, the stride doubling (and every other point dropped) each
    time the curve fills, so a long run's curve stays small and so does the cost
    of sorting the window (paid only at recorded batches)."""

    def __init__(self, examples: int = 100_000, batches: Optional[int] = None, max_points: int = 2000):
        if batches is not None and (isinstance(batches, bool) or int(batches) < 1):
            raise ValueError(f"online window: batches must be >= 1, got {batches!r}")
        if batches is None and (isinstance(examples, bool) or int(examples) < 1):
            raise ValueError(f"online window: examples must be >= 1, got {examples!r}")
        self.window_examples = None if batches is not None else int(examples)
        self.window_batches = None if batches is None else int(batches)
        self._parts: deque = deque()  # (labels, probs) of a batch, oldest first
        self.size = 0                 # examples in the window
        self.scored = 0               # examples scored since the start
        self.history: list = []       # record()'s points
        self.stride = 1               # record() keeps every stride-th batch
        self.max_points = max(2, int(max_points))
        self._recorded_batches = 0

    def state_dict(self) -> dict:
        """What a checkpoint keeps, so a resumed run's window and curve go on as if
        it never stopped: the window's labels and scores, the counts, the curve."""
        labels = np.concatenate([y for y, _ in self._parts]) if self._parts else np.empty(0)
        probs = np.concatenate([p for _, p in self._parts]) if self._parts else np.empty(0)
        return {"window_examples": self.window_examples, "window_batches": self.window_batches,
                "lengths": [len(y) for y, _ in self._parts], "labels": labels, "probs": probs,
                "scored": self.scored, "history": list(self.history), "stride": self.stride,
                "recorded_batches": self._recorded_batches}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's window; its size must be this window's (the config's)."""
        if (state["window_examples"], state["window_batches"]) != (self.window_examples, self.window_batches):
            raise ValueError(f"online window: the checkpoint's window is {_describe(state)}, the config's "
                             f"{_describe({'window_examples': self.window_examples, 'window_batches': self.window_batches})}"
                             f"; resume with the window it was trained with")
        bounds = np.cumsum([0] + list(state["lengths"]))
        labels, probs = np.asarray(state["labels"], np.float64), np.asarray(state["probs"], np.float64)
        self._parts = deque((labels[a:z], probs[a:z]) for a, z in zip(bounds, bounds[1:]))
        self.size = int(bounds[-1])
        self.scored = int(state["scored"])
        self.history = list(state["history"])
        self.stride = int(state["stride"])
        self._recorded_batches = int(state["recorded_batches"])

    def add(self, labels: np.ndarray, probs: np.ndarray) -> None:
        labels = np.asarray(labels, np.float64)
        probs = np.asarray(probs, np.float64)
        if labels.shape != probs.shape:
            raise ValueError(f"online window: {len(labels)} labels for {len(probs)} scores")
        if not len(labels):  # a rank whose data ended, stepping on empty with the others: no batch of examples
            return
        self._parts.append((labels, probs))
        self.size += len(labels)
        self.scored += len(labels)
        if self.window_batches is not None:
            while len(self._parts) > self.window_batches:
                self.size -= len(self._parts.popleft()[0])
            return
        while self.size - len(self._parts[0][0]) >= self.window_examples:
            self.size -= len(self._parts.popleft()[0])
        extra = self.size - self.window_examples
        if extra > 0:  # the oldest batch only in part
            y, p = self._parts[0]
            self._parts[0] = (y[extra:], p[extra:])
            self.size -= extra

    def metrics(self) -> dict:
        """{"auc", "logloss", "window_examples", "scored_examples"} over the window
        (AUC is NaN while the window holds one class only)."""
        if not self.size:
            return {"auc": float("nan"), "logloss": float("nan"), "window_examples": 0,
                    "scored_examples": int(self.scored)}
        y = np.concatenate([a for a, _ in self._parts])
        p = np.concatenate([b for _, b in self._parts])
        return {"auc": auc(y, p), "logloss": logloss(y, p), "window_examples": int(self.size),
                "scored_examples": int(self.scored)}

    def record(self, **fields) -> Optional[dict]:
        """Once a batch, after ``add``: on every ``stride``-th call, ``fields`` and
        ``metrics()`` as one point of ``history`` (returned); else None."""
        self._recorded_batches += 1
        if self._recorded_batches % self.stride:
            return None
        point = {**fields, **self.metrics()}
        self.history.append(point)
        if len(self.history) >= self.max_points:
            self.history = self.history[1::2]  # the points at multiples of 2 * stride
            self.stride *= 2
        return point


def _describe(state: dict) -> str:
    if state["window_batches"] is not None:
        return f"{state['window_batches']:,} batches"
    return f"{state['window_examples']:,} examples"
