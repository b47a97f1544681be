"""Several passes over finite data, each through a seeded shuffle buffer: :class:`Epochs`.

Users train small and medium data sets several times (``[data] epochs = N``). A
shuffle buffer of ``shuffle_buffer`` rows mixes rows across the reader's batches
and files without holding the data set in memory: each incoming batch of m rows
joins the buffer, and m rows drawn at random from the buffer go out. The draws
come from a generator seeded by (seed, epoch), so the stream is the same on every
run (what ``--resume`` relies on: it skips the batches already trained).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from hps.data.examples import Bags, Batch, _check_batching
from hps.data.files import _Reader


def _take(batch: Batch, idx: np.ndarray) -> Batch:
    """Rows ``idx`` (any order) of a batch; its sources are dropped (rows no longer follow lines)."""
    bags = []
    for b in batch.bags:
        lens = np.diff(b.offsets)[idx]
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        sel = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lens) + np.repeat(b.offsets[:-1][idx], lens)
        bags.append(Bags(b.keys[sel], offsets, None if b.weights is None else b.weights[sel]))
    return Batch(batch.labels[idx], batch.dense[idx], batch.keys[idx], (), tuple(bags))


def _concat(batches: list) -> Batch:
    if len(batches) == 1:
        return batches[0]
    return Batch(np.concatenate([b.labels for b in batches]), np.concatenate([b.dense for b in batches]),
                 np.concatenate([b.keys for b in batches]), (),
                 tuple(Bags.concat([b.bags[j] for b in batches]) for j in range(len(batches[0].bags))))


class Epochs:
    """``epochs`` passes over ``source`` (a re-iterable of :class:`Batch`, such as a reader),
    through a shuffle buffer of ``shuffle_buffer`` rows (0: the source's order).

    Yields batches of ``batch_size`` rows (default: the source's), the last of each
    epoch smaller unless ``drop_last`` (unshuffled: the source's batches as they are).
    Shuffled batches carry no ``sources``. Other
    attributes are the source's (``files``, ``widths``, ``stats`` ...).

    >>> from hps.data import SyntheticCriteo
    >>> gen = SyntheticCriteo(seed=1, batch_size=4, examples=10)
    >>> [len(b) for b in Epochs(gen, epochs=2, shuffle_buffer=6, seed=7)]
    [4, 4, 2, 4, 4, 2]
    """

    def __init__(self, source, epochs: int = 1, shuffle_buffer: int = 0, seed: int = 0, batch_size=None,
                 drop_last: bool = False):
        if isinstance(epochs, bool) or not isinstance(epochs, (int, np.integer)) or epochs < 1:
            raise ValueError(f"epochs must be an int >= 1, got {epochs!r}")
        if isinstance(shuffle_buffer, bool) or not isinstance(shuffle_buffer, (int, np.integer)) or shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be an int >= 0 (rows), got {shuffle_buffer!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")  # (numpy's generators: at the first pass)
        batch_size = batch_size if batch_size is not None else getattr(source, "batch_size", None)
        _check_batching(batch_size, 0, 1)
        self.source = source
        self.epochs = int(epochs)
        self.shuffle_buffer = int(shuffle_buffer)
        self.seed = int(seed)
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)

    def __getattr__(self, name):
        if name == "source":  # not set yet (during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.source, name)

    def __iter__(self) -> Iterator[Batch]:
        for epoch in range(self.epochs):
            # Unshuffled: the source's own batches, sources and all.
            yield from self._rebatch(self._shuffled(epoch)) if self.shuffle_buffer else self.source

    def _shuffled(self, epoch: int) -> Iterator[Batch]:
        rng = np.random.default_rng([self.seed, epoch])
        buf = None
        for batch in self.source:
            buf = batch if buf is None else _concat([buf, batch])
            extra = len(buf) - self.shuffle_buffer
            if extra > 0:
                out = rng.choice(len(buf), extra, replace=False)
                keep = np.ones(len(buf), bool)
                keep[out] = False
                yield _take(buf, out)
                buf = _take(buf, np.flatnonzero(keep))
        if buf is not None and len(buf):
            yield _take(buf, rng.permutation(len(buf)))

    def _rebatch(self, batches) -> Iterator[Batch]:
        pending, have = [], 0
        for b in batches:
            while len(b):
                take = min(self.batch_size - have, len(b))
                pending.append(_take(b, np.arange(take)) if take < len(b) else b)
                b = _take(b, np.arange(take, len(b)))
                have += take
                if have == self.batch_size:
                    yield _concat(pending)
                    pending, have = [], 0
        if have and not self.drop_last:
            yield _concat(pending)



class FirstExamples:
    """The first ``examples`` rows of each pass over ``source`` (a re-iterable of
    :class:`Batch`), the batch that crosses the limit cut short: what ``[data]
    train_examples`` (``--examples``) means for files. After a pass,
    ``examples_seen`` is how many it yielded, fewer than asked when the data holds
    fewer. Other attributes are the source's.

    >>> from hps.data import SyntheticCriteo
    >>> [len(b) for b in FirstExamples(SyntheticCriteo(seed=1, batch_size=4, examples=10), 6)]
    [4, 2]
    """

    def __init__(self, source, examples: int):
        if isinstance(examples, bool) or not isinstance(examples, (int, np.integer)) or examples < 0:
            raise ValueError(f"examples must be an int >= 0, got {examples!r}")
        self.source = source
        self.examples = int(examples)
        self.examples_seen = 0

    def __getattr__(self, name):
        if name == "source":  # not set yet (during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.source, name)

    def __iter__(self) -> Iterator[Batch]:
        self.examples_seen = 0
        if self.examples == 0:
            return
        # A reader ends its pass at the count: a malformed line past the examples taken,
        # in a block parsed whole, is then neither raised nor counted (_Reader._pass).
        batches = self.source._pass(self.examples) if isinstance(self.source, _Reader) else self.source
        for batch in batches:
            left = self.examples - self.examples_seen
            if len(batch) > left:
                batch = batch.rows(np.arange(left))
            self.examples_seen += len(batch)
            yield batch
            if self.examples_seen == self.examples:
                return


def skip_examples(batches, examples: int) -> Iterator[Batch]:
    """``batches`` without their first ``examples`` rows (a batch that straddles the
    point cut): where a resumed run picks up, whatever batch sizes the run before
    it ended with."""
    for batch in batches:
        if examples >= len(batch):
            examples -= len(batch)
            continue
        if examples:
            batch = batch.rows(np.arange(examples, len(batch)))
            examples = 0
        yield batch
