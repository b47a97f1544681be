"""The examples batch every hps.data source yields, and how sources cut rows into batches.

A :class:`Batch` is a mini-batch of *examples* (labels, dense features, one key
per categorical field), not the parameter server's working set of rows
(``hps.ParameterServer.batch``, ``hps.Batch``); :class:`Source` says which input
lines its rows came from. Readers and generators produce rows in pieces of any
length (a parsed block, a generated block) and :func:`_rebatch` cuts that stream
into batches of ``batch_size`` rows, so the batches do not depend on the block size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import numpy as np

@dataclass(frozen=True)
class Source:
    """``count`` consecutive examples from ``path`` starting at line (or Parquet row) ``first_line``."""

    path: str
    first_line: int
    count: int


@dataclass(frozen=True, eq=False)
class Bags:
    """The bags of one multi-hot field over a batch's rows, as nn.EmbeddingBag takes them.

    keys (m,) uint64, the keys of every row in row order; offsets (n + 1,) int64,
    row i's keys are ``keys[offsets[i]:offsets[i + 1]]`` (an empty bag is a row
    without a value); weights (m,) float32 or None, a weight a key (libsvm's values).
    """

    keys: np.ndarray
    offsets: np.ndarray
    weights: "np.ndarray | None" = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def rows(self, a: int, z: int) -> "Bags":
        """The bags of rows a..z-1, offsets from 0."""
        lo, hi = int(self.offsets[a]), int(self.offsets[z])
        return Bags(self.keys[lo:hi], self.offsets[a:z + 1] - lo,
                    None if self.weights is None else self.weights[lo:hi])

    @staticmethod
    def concat(parts: "list[Bags]") -> "Bags":
        starts = np.cumsum([0] + [len(p.keys) for p in parts])
        offsets = np.concatenate([parts[0].offsets[:1]]
                                 + [p.offsets[1:] + s for p, s in zip(parts, starts[:-1], strict=True)])
        weights = None if parts[0].weights is None else np.concatenate([p.weights for p in parts])
        return Bags(np.concatenate([p.keys for p in parts]), offsets.astype(np.int64), weights)


@dataclass(frozen=True, eq=False)
class Batch:
    """One mini-batch of examples; hps.data's docstring gives the meaning of each array.

    labels (n,) float32, dense (n, n_dense) float32, keys (n, n_categorical)
    uint64, sources: the input spans the rows came from, in row order.
    """

    labels: np.ndarray
    dense: np.ndarray
    keys: np.ndarray
    sources: tuple[Source, ...] = ()
    #: One :class:`Bags` a multi-hot field (a schema's ``multi_hot``, libsvm's fields), in field order.
    bags: tuple["Bags", ...] = ()

    def __len__(self) -> int:
        return len(self.labels)

    def all_keys(self) -> np.ndarray:
        """Every key of the batch, single-hot and in bags, as one 1-D array (the working set's keys)."""
        if not self.bags:
            return self.keys
        return np.concatenate([self.keys.reshape(-1)] + [b.keys for b in self.bags])

    def rows(self, idx: np.ndarray) -> "Batch":
        """The batch of rows ``idx`` (consecutive, increasing: a mini-batch's share, the
        batch that --examples or a resume point cuts), with the sources of those rows."""
        if len(idx) == 0:
            return Batch(self.labels[:0], self.dense[:0], self.keys[:0], (), tuple(b.rows(0, 0) for b in self.bags))
        a, z = int(idx[0]), int(idx[-1]) + 1
        if z - a != len(idx):
            raise ValueError("rows: idx must be consecutive")
        return Batch(self.labels[a:z], self.dense[a:z], self.keys[a:z], _spans(self.sources, a, z),
                     tuple(b.rows(a, z) for b in self.bags))

    def locate(self, i: int) -> tuple[str, int]:
        """(path, line) of row ``i``: where to look when that example misbehaves."""
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for a batch of {len(self)}")
        for s in self.sources:
            if i < s.count:
                return s.path, s.first_line + i
            i -= s.count
        raise IndexError("the batch's sources do not cover its rows")


def _spans(sources, a: int, z: int) -> tuple:
    """The sources of rows a..z-1 of rows that ``sources`` cover in order (none if they do
    not cover them all: a batch made without sources)."""
    if sum(s.count for s in sources) < z:
        return ()
    out, start = [], 0
    for s in sources:
        lo, hi = max(a, start), min(z, start + s.count)
        if lo < hi:
            out.append(Source(s.path, s.first_line + lo - start, hi - lo))
        start += s.count
    return tuple(out)


class _Piece:
    """Rows on their way into batches (a parsed block, before re-batching)."""

    __slots__ = ("labels", "dense", "keys", "sources", "bags")

    def __init__(self, labels, dense, keys, sources, bags=()):
        self.labels, self.dense, self.keys, self.sources = labels, dense, keys, list(sources)
        self.bags = tuple(bags)

    def __len__(self):
        return len(self.labels)

    def split(self, k: int) -> tuple["_Piece", "_Piece"]:
        head, tail, left = [], [], k
        for s in self.sources:
            if left >= s.count:
                head.append(s)
            elif left <= 0:
                tail.append(s)
            else:
                head.append(Source(s.path, s.first_line, left))
                tail.append(Source(s.path, s.first_line + left, s.count - left))
            left -= s.count
        n = len(self.labels)
        return (_Piece(self.labels[:k], self.dense[:k], self.keys[:k], head, (b.rows(0, k) for b in self.bags)),
                _Piece(self.labels[k:], self.dense[k:], self.keys[k:], tail, (b.rows(k, n) for b in self.bags)))


def _merged(sources: Iterable[Source]) -> tuple[Source, ...]:
    """Sources with each run of consecutive lines of one file as one span."""
    out: list[Source] = []
    for s in sources:
        if out and out[-1].path == s.path and out[-1].first_line + out[-1].count == s.first_line:
            out[-1] = Source(s.path, out[-1].first_line, out[-1].count + s.count)
        else:
            out.append(s)
    return tuple(out)


def _batch_of(pieces: list[_Piece]) -> Batch:
    if len(pieces) == 1:
        p = pieces[0]
        return Batch(p.labels, p.dense, p.keys, tuple(p.sources), p.bags)
    return Batch(np.concatenate([p.labels for p in pieces]),
                 np.concatenate([p.dense for p in pieces]),
                 np.concatenate([p.keys for p in pieces]),
                 _merged(s for p in pieces for s in p.sources),
                 tuple(Bags.concat([p.bags[j] for p in pieces]) for j in range(len(pieces[0].bags))))


def _rebatch(pieces: Iterable[_Piece], batch_size: int, drop_last: bool,
             limit: Optional[int] = None) -> Iterator[Batch]:
    """Cuts a stream of pieces of any length into batches of batch_size rows; with a
    ``limit``, ends at that many rows (the batch that reaches it cut short) without
    asking ``pieces`` for more."""
    if limit == 0:
        return
    pending: list[_Piece] = []
    have = 0
    for piece in pieces:
        while len(piece):
            take = min(batch_size - have, len(piece))
            if limit is not None:
                take = min(take, limit)
                limit -= take
            head, piece = piece.split(take)
            pending.append(head)
            have += take
            if have == batch_size or limit == 0:
                yield _batch_of(pending)
                pending, have = [], 0
                if limit == 0:
                    return
    if have and not drop_last:
        yield _batch_of(pending)


def _sources_of(path: str, lines: np.ndarray) -> list[Source]:
    """Sources for rows at the given (increasing) line numbers: one per run of consecutive lines."""
    if len(lines) == 0:
        return []
    breaks = np.flatnonzero(np.diff(lines) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(lines)]])
    return [Source(path, int(lines[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]


def _check_batching(batch_size, rank, world):
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not (isinstance(world, (int, np.integer)) and world >= 1):
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    if not (isinstance(rank, (int, np.integer)) and 0 <= rank < world):
        raise ValueError(f"rank must be in [0, world={world}), got {rank!r}")
