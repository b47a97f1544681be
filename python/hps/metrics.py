"""Evaluation metrics of a CTR model: AUC and logloss over held-out examples.

>>> auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8])
0.75
>>> round(logloss(np.array([1, 0]), np.array([0.9, 0.2])), 4)
0.1643
"""
from __future__ import annotations

import numpy as np

__all__ = ["auc", "logloss"]


def _paired(metric: str, labels, scores, name: str) -> tuple[np.ndarray, np.ndarray]:
    """labels and scores as arrays of one example each, or a ValueError naming both
    sizes: unchecked, auc raised numpy's IndexError and logloss broadcast a score
    (or an (n, 1) column) against every label, a number with no error."""
    labels, scores = np.asarray(labels), np.asarray(scores)
    if labels.ndim != 1 or scores.ndim != 1:
        raise ValueError(f"{metric}: {name} of shape {scores.shape}, labels of shape {labels.shape}: give 1-D arrays, "
                         f"one entry an example")
    if len(labels) != len(scores):
        raise ValueError(f"{metric}: {len(labels)} labels but {len(scores)} {name}: give one an example")
    return labels, scores


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (ties count half), by ranks; NaN where it is
    undefined: one class only, or a score that is not a finite number. labels and
    scores are 1-D, of one length (ValueError otherwise)."""
    labels, scores = _paired("auc", labels, scores, "scores")
    labels = labels > 0.5
    pos = int(labels.sum())
    neg = len(labels) - pos
    if pos == 0 or neg == 0 or not np.isfinite(scores).all():  # (NaNs would sort anywhere: an AUC of noise)
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores), np.float64)
    # Average ranks over ties.
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [len(scores)]])
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def logloss(labels: np.ndarray, probs: np.ndarray) -> float:
    """Mean binary cross-entropy of probs against labels (0 or 1), probs clipped to [1e-7, 1 - 1e-7].
    labels and probs are 1-D, of one length (ValueError otherwise)."""
    labels, probs = _paired("logloss", labels, probs, "probs")
    p = np.clip(probs, 1e-7, 1 - 1e-7)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))
