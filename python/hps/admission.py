"""Admission: a key gets a trainable row only after it has been seen ``threshold`` times.

Most keys of CTR data are rare: a key seen once or twice gets a row that takes
memory and learns little. With admission, the occurrences of each key are counted
in a count-min sketch of saturating 8-bit counters (``include/hps/admission.h``),
bounded in memory whatever the number of keys; an occurrence whose key's count is
still below the threshold reads one fixed default row instead, the row of the
reserved key :data:`ADMISSION_DEFAULT_KEY`, and its gradient is dropped (hps.torch
zeroes the gradients of that key, so the optimizer leaves the row as the
initializer made it). The sketch never counts below the truth, so a key is admitted
at its f-th occurrence or, when its counters are shared with other keys, earlier.

A batch is counted whole before it is answered: every occurrence of a key in one
batch gets the same answer, so a key seen for the f-th time in a batch is admitted
for all its occurrences there.

Example::

    >>> import numpy as np
    >>> from hps.admission import AdmissionSketch
    >>> s = AdmissionSketch(threshold=3, bytes="64KiB")
    >>> s.admit(np.array([7, 8, 7], dtype=np.uint64)).tolist()
    [False, False, False]
    >>> s.admit(np.array([7, 9], dtype=np.uint64)).tolist()   # key 7's third occurrence
    [True, False]
    >>> s.query(np.array([7, 8], dtype=np.uint64)).tolist(), s.estimate(np.array([8], dtype=np.uint64)).tolist()
    ([True, False], [1])

In training (``[admission]`` in ``hps train``'s TOML; docs/training.md) the
pipeline's read stage rewrites each batch's keys, and evaluation batches are
answered by :meth:`AdmissionSketch.query`, which counts nothing. The read stage
counts batches ahead of the one trained, so an evaluation in the middle of a run
answers with a copy of the counters that the read stage kept when it counted the
last batch trained before it (:meth:`Admission.keep_for_evaluations`).

Under mpiexec the count is the job's: every rank keeps the same sketch and counts
every rank's keys of each global step (:meth:`Admission.train_job_batch`: the
step's keys are all-gathered, in rank order), so a key is admitted once the job's
data has shown it ``threshold`` times, wherever its occurrences were read, and the
answers are exactly those of one process trained on the global batches (the
ranks' batches one after the other). The price is the all-gather: each rank
receives every other rank's keys of each step (8 bytes an occurrence; counted as
``admission`` bytes).

Caveats: counters saturate at 255 (thresholds go up to 255).
"""
from __future__ import annotations

import dataclasses
import hashlib
import threading
from typing import Optional, Union

import numpy as np

from hps import _core
from hps.config import parse_bytes
from hps.data.keys import ADMISSION_DEFAULT_KEY

__all__ = ["ADMISSION_DEFAULT_KEY", "Admission", "AdmissionSketch"]

_DEFAULT = np.uint64(ADMISSION_DEFAULT_KEY)


def _int_in(value, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return int(value)


def _flat_keys(keys) -> np.ndarray:
    keys = np.asarray(keys)
    if keys.dtype not in (np.uint64, np.int64):
        raise TypeError(f"keys must be uint64 or int64, got {keys.dtype}")
    return np.ascontiguousarray(keys).reshape(-1).view(np.uint64)


class AdmissionSketch:
    """A count-min sketch of ``rows`` arrays of uint8 counters, ``bytes`` in all, that
    admits a key once its estimated count reaches ``threshold`` (1 to 255).

    Counters: ``occurrences`` (keys counted by :meth:`admit`), ``admitted`` (of them,
    answered admitted) and ``keys_admitted`` (keys whose own occurrence took their
    estimate to the threshold: the keys admitted, less the few that other keys'
    counts pushed over). Not thread-safe: one thread counts.
    """

    def __init__(self, threshold: int, bytes: Union[int, str] = "4MiB", rows: int = 4, seed: int = 0):
        self.threshold = _int_in(threshold, "threshold", 1, 255)
        self.rows = _int_in(rows, "rows", 1, 16)
        nbytes = parse_bytes(bytes, "bytes")
        if nbytes < self.rows:
            raise ValueError(f"bytes must be at least rows = {self.rows} (one counter a byte), got {bytes!r}")
        self.seed = _int_in(seed, "seed", 0, (1 << 64) - 1)
        self._native = _core.AdmissionSketch(nbytes, self.rows, self.threshold, self.seed)
        self.occurrences = 0
        self.admitted = 0
        self.keys_admitted = 0

    @property
    def bytes(self) -> int:
        """The counters' bytes (rows x width; the bytes asked for, rounded down to a multiple of rows)."""
        return self._native.bytes

    @property
    def width(self) -> int:
        """Counters an array."""
        return self._native.width

    def admit(self, keys) -> np.ndarray:
        """Counts every key of ``keys`` (any shape, uint64 or int64), then answers: a bool
        array of keys' shape, True where the key's estimate is >= threshold."""
        shape = np.shape(keys)
        mask, admitted, new = self._native.admit(_flat_keys(keys))
        self.occurrences += int(mask.size)
        self.admitted += int(admitted)
        self.keys_admitted += int(new)
        return mask.reshape(shape)

    def query(self, keys) -> np.ndarray:
        """admit's answer without counting (for evaluation)."""
        mask, _ = self._native.query(_flat_keys(keys))
        return mask.reshape(np.shape(keys))

    def estimate(self, keys) -> np.ndarray:
        """The estimated counts (uint8, 0 to 255) of keys, flattened: never below the true counts."""
        return self._native.estimate(_flat_keys(keys))

    def counters(self) -> np.ndarray:
        """A copy of the counters, (rows * width,) uint8."""
        return self._native.counters()

    def state_dict(self) -> dict:
        """The whole state (options, counters, counts), for a checkpoint."""
        return {"threshold": self.threshold, "rows": self.rows, "bytes": self.bytes, "seed": self.seed,
                "counters": self.counters(), "occurrences": self.occurrences, "admitted": self.admitted,
                "keys_admitted": self.keys_admitted}

    def load_state_dict(self, state: dict) -> None:
        """Restores a state_dict of a sketch with the same threshold, rows, bytes and seed;
        raises ValueError naming the one that differs."""
        for name in ("threshold", "rows", "bytes", "seed"):
            if state[name] != getattr(self, name):
                raise ValueError(f"the saved admission sketch has {name} = {state[name]}, this one "
                                 f"{getattr(self, name)}")
        self._native.restore(np.ascontiguousarray(state["counters"], dtype=np.uint8))
        self.occurrences, self.admitted, self.keys_admitted = \
            int(state["occurrences"]), int(state["admitted"]), int(state["keys_admitted"])


class Admission:
    """Admission in training: rewrites batches (hps.data.Batch) so that the occurrences
    not admitted read :data:`ADMISSION_DEFAULT_KEY`, and counts what it did.

    ``threshold`` 1 admits every key and keeps no sketch: batches pass unchanged.
    Counters: ``default_reads`` (training occurrences that read the default row;
    each one's gradient is dropped, so ``dropped_gradients`` is the same number),
    ``eval_reads`` / ``eval_default_reads`` (of the last evaluation). In a job
    (:meth:`train_job_batch`) these and the sketch's are the job's, the same on
    every rank; ``rank_occurrences`` / ``rank_default_reads`` are this rank's
    part (since the job last changed its number of ranks: a reshard sets them to 0).
    """

    def __init__(self, threshold: int = 1, sketch_bytes: Union[int, str] = "4MiB", seed: int = 0):
        self.threshold = _int_in(threshold, "threshold", 1, 255)
        self.sketch = AdmissionSketch(threshold, sketch_bytes, seed=seed) if self.threshold > 1 else None
        self.default_reads = 0
        self.eval_reads = 0
        self.eval_default_reads = 0
        self.rank_occurrences = 0
        self.rank_default_reads = 0
        self._eval_pass = [0, 0]
        self._eval_every = 0      # keep_for_evaluations' cadence (0: no copies)
        self._counted = 0         # batches the read stage counted (a resumed run's included)
        self._kept = {}           # batches counted -> the counters then (guarded by _kept_lock)
        self._kept_lock = threading.Lock()
        self._eval_sketch: Optional[AdmissionSketch] = None  # holds a kept copy for an evaluation
        self._eval_query = None   # what eval_batch answers with (None: the sketch's query)

    @property
    def enabled(self) -> bool:
        return self.sketch is not None

    def train_batch(self, batch):
        """The batch with each key not admitted (after counting the batch) replaced."""
        if self.sketch is None:
            return batch
        out, defaults = _rewrite(batch, self.sketch.admit)
        self.default_reads += defaults
        self._batch_counted()
        return out

    def train_job_batch(self, batch, node):
        """train_batch for one rank of a job (hps.distributed.Node): the step's keys of
        every rank are counted, rank 0's first, as one batch (the global batch), then
        this rank's batch is rewritten with its part of the answer. Collective: every
        rank calls it once a step, in the same thread as the read stage's other
        collectives (an empty batch where a rank's data has ended)."""
        if self.sketch is None:
            return batch
        parts = _parts(batch)
        every = node.allgather("read", parts, "admission (the step's keys)")
        node.count("admission", sum(p.nbytes for p in parts) * (node.size - 1))
        mask = self.sketch.admit(np.concatenate([every[r][i] for i in range(len(parts))
                                                 for r in range(node.size)]))
        self.default_reads += int(mask.size - np.count_nonzero(mask))
        mine, at = [], 0
        for i, part in enumerate(parts):
            at += sum(len(every[r][i]) for r in range(node.rank))
            mine.append(mask[at:at + len(part)])
            at += sum(len(every[r][i]) for r in range(node.rank, node.size))
        self.rank_occurrences += sum(len(p) for p in parts)
        out, defaults = _apply(batch, mine)
        self.rank_default_reads += defaults
        self._batch_counted()
        return out

    def keep_for_evaluations(self, every: int, done: int = 0) -> None:
        """Evaluations after every `every` batches trained (hps train's eval_every)
        answer as the batches trained by then left the sketch, not as the read
        stage, which counts batches ahead of the one trained (its queues), has
        left it by the time the trainer evaluates: each time the read stage has
        counted a multiple of `every` batches (`done`: a resumed run's batches
        before), it keeps a copy of the counters, which begin_evaluation(that
        many) takes. A copy costs the sketch's bytes; at most as many are held as
        the read stage is ahead by evaluations (with eval_every = 1, the batches
        it is ahead)."""
        with self._kept_lock:
            self._eval_every, self._counted = int(every), int(done)
            self._kept.clear()

    def _batch_counted(self) -> None:
        """The read stage counted one more batch (in its thread)."""
        self._counted += 1
        if self._eval_every and self._counted % self._eval_every == 0:
            counters = self.sketch.counters()
            with self._kept_lock:
                self._kept[self._counted] = counters

    def agree(self, node) -> bool:
        """Collective, on resume in a job: makes every rank's sketch and job counters
        the same. A checkpoint of a job whose ranks counted only their own batches
        (hps before job-wide counting) holds a sketch a rank: they are summed
        (saturating), which bounds the job's counts from above as each rank's sketch
        bounds its own. Returns whether anything changed."""
        if self.sketch is None:
            return False
        counters = self.sketch.counters()
        digest = hashlib.sha256(counters.tobytes()).hexdigest()
        mine = (digest, self.sketch.occurrences, self.sketch.admitted, self.sketch.keys_admitted,
                self.default_reads)
        every = node.allgather("train", mine, "admission (the sketches agree)")
        if len(set(every)) == 1:
            return False
        sketches = node.allgather("train", counters, "admission (the ranks' sketches)")
        merged = np.minimum(np.sum(np.stack(sketches).astype(np.uint32), axis=0), 255).astype(np.uint8)
        self.sketch._native.restore(merged)
        self.sketch.occurrences = sum(e[1] for e in every)
        self.sketch.admitted = sum(e[2] for e in every)
        self.sketch.keys_admitted = sum(e[3] for e in every)  # (an upper bound: a key may count on several)
        self.default_reads = sum(e[4] for e in every)
        return True

    def begin_evaluation(self, trained: Optional[int] = None) -> None:
        """Starts an evaluation after `trained` batches: eval_batch answers with the
        counters kept when the read stage counted that many (keep_for_evaluations),
        else (none kept: the read stage is done, or keeps none) with the sketch's."""
        if self.sketch is None:
            return
        with self._kept_lock:
            counters = self._kept.pop(trained, None) if trained is not None else None
            for n in [n for n in self._kept if trained is not None and n < trained]:
                del self._kept[n]  # (an evaluation skipped)
        if counters is None:
            self._eval_query = None
            return
        if self._eval_sketch is None:
            s = self.sketch
            self._eval_sketch = AdmissionSketch(s.threshold, s.bytes, rows=s.rows, seed=s.seed)
        self._eval_sketch._native.restore(counters)
        self._eval_query = self._eval_sketch.query

    def eval_batch(self, batch):
        """The batch as evaluation reads it: keys never admitted replaced, nothing counted."""
        if self.sketch is None:
            return batch
        out, defaults = _rewrite(batch, self._eval_query or self.sketch.query)
        self._eval_pass[0] += _occurrences(batch)
        self._eval_pass[1] += defaults
        return out

    def end_evaluation(self) -> None:
        """Closes an evaluation's counts (eval_reads, eval_default_reads)."""
        self.eval_reads, self.eval_default_reads = self._eval_pass
        self._eval_pass = [0, 0]
        self._eval_query = None

    def state_dict(self) -> dict:
        return {"threshold": self.threshold, "default_reads": self.default_reads, "eval_reads": self.eval_reads,
                "eval_default_reads": self.eval_default_reads, "rank_occurrences": self.rank_occurrences,
                "rank_default_reads": self.rank_default_reads,
                "sketch": None if self.sketch is None else self.sketch.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["threshold"] != self.threshold:
            raise ValueError(f"the checkpoint was trained with [admission] threshold = {state['threshold']}, "
                             f"this run has {self.threshold}")
        self.default_reads = int(state["default_reads"])
        self.eval_reads, self.eval_default_reads = int(state["eval_reads"]), int(state["eval_default_reads"])
        self.rank_occurrences = int(state.get("rank_occurrences", 0))
        self.rank_default_reads = int(state.get("rank_default_reads", 0))
        if self.sketch is not None:
            saved = state["sketch"]
            if saved["bytes"] != self.sketch.bytes:
                raise ValueError(f"the checkpoint counted admission in a sketch of {saved['bytes']:,} bytes, this "
                                 f"run's [admission] sketch_bytes gives {self.sketch.bytes:,}; resume with "
                                 f"sketch_bytes = {saved['bytes']}")
            self.sketch.load_state_dict(saved)

    def summary(self) -> dict:
        s = self.sketch
        counted = s.occurrences if s is not None else None
        return {"threshold": self.threshold, "sketch_bytes": s.bytes if s is not None else 0,
                "sketch_rows": s.rows if s is not None else 0,
                "occurrences_counted": counted,
                "keys_admitted": s.keys_admitted if s is not None else None,
                "default_reads": self.default_reads, "dropped_gradients": self.default_reads,
                "default_read_fraction": self.default_reads / counted if counted else 0.0,
                "eval_reads": self.eval_reads, "eval_default_reads": self.eval_default_reads}

    def rank_summary(self) -> dict:
        """This rank's part of a job's counts (summary's are the job's)."""
        return {"occurrences": self.rank_occurrences, "default_reads": self.rank_default_reads}


def _occurrences(batch) -> int:
    return int(np.size(batch.keys)) + sum(len(b.keys) for b in getattr(batch, "bags", ()))


def _parts(batch) -> list:
    """The batch's keys as flat uint64 arrays: the single-hot fields' (row-major),
    then each multi-hot field's. Concatenating two batches' rows concatenates
    their parts one by one."""
    return [_flat_keys(batch.keys)] + [_flat_keys(b.keys) for b in getattr(batch, "bags", ())]


def _rewrite(batch, answer) -> tuple:
    """(batch with the keys `answer` rejects replaced by the default key, how many)."""
    bags = getattr(batch, "bags", ())
    keys = np.asarray(batch.keys)
    if not bags:
        mask = answer(keys)
        defaults = int(mask.size - np.count_nonzero(mask))
        if not defaults:
            return batch, 0
        return dataclasses.replace(batch, keys=np.where(mask, keys, _DEFAULT)), defaults
    # One sketch call for the single-hot keys and every bag: the batch is counted whole.
    parts = _parts(batch)
    mask = answer(np.concatenate(parts))
    return _apply(batch, np.split(mask, np.cumsum([len(p) for p in parts])[:-1]))


def _apply(batch, masks: list) -> tuple:
    """(batch with the keys where masks (one a part, _parts' order) are False
    replaced by the default key, how many)."""
    defaults = sum(int(m.size - np.count_nonzero(m)) for m in masks)
    if not defaults:
        return batch, 0
    bags = getattr(batch, "bags", ())
    keys = np.asarray(batch.keys)
    new_keys = np.where(masks[0].reshape(keys.shape), keys, _DEFAULT)
    if not bags:
        return dataclasses.replace(batch, keys=new_keys), defaults
    new_bags = tuple(dataclasses.replace(b, keys=np.where(m, b.keys, _DEFAULT))
                     for b, m in zip(bags, masks[1:], strict=True))
    return dataclasses.replace(batch, keys=new_keys, bags=new_bags), defaults
