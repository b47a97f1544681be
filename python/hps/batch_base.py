"""What every working batch shares (hps.parameter_server's device-tier and host
batches, Herald's batches on one node and across ranks): finish(), the with-block
protocol, positions / gather / accumulate for a batch that looks rows up by key,
and finding a batch's keys among the keys it prefetched; and what the owners of
Herald's caches share: stopping after a failed step, and batches scheduled when
made and run later in that order."""
from __future__ import annotations

import collections
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Optional

import numpy as np


def prefetched_positions(flat: np.ndarray, prefetched: np.ndarray, inverse: np.ndarray) -> Optional[np.ndarray]:
    """inverse's entries for `flat` when it is the prefetched keys themselves
    (the same bytes, as a view of any dtype of their width), a run of them in
    their memory (a worker's share of a batch's examples is a slice of them),
    or a copy of them, compared; else None."""
    if flat.itemsize != prefetched.itemsize or flat.nbytes > prefetched.nbytes:
        return None
    offset = flat.ctypes.data - prefetched.ctypes.data
    if 0 <= offset <= prefetched.nbytes - flat.nbytes and offset % flat.itemsize == 0:
        start = offset // flat.itemsize
        return inverse if len(flat) == len(inverse) else inverse[start:start + len(flat)]
    if flat.nbytes == prefetched.nbytes and np.array_equal(flat.view(prefetched.dtype), prefetched):
        return inverse
    return None


def report_cleanup_error(e: BaseException, failure: Optional[BaseException]) -> None:
    """A cleanup's error `e`, while `failure` is the error raised: to stderr (hps
    has no logger)."""
    print(f"hps: a cleanup failed too, after {type(failure).__name__}: {failure}", file=sys.stderr)
    traceback.print_exception(e)


def release_after(failure: BaseException, release) -> None:
    """Cleanup while `failure` is in flight (a batch's abort after its step
    failed): release(). An error of its own goes to stderr, not in the place of
    `failure`, which says what failed: a release that failed too (an unpin of a
    key something else unpinned) told the caller that, and not that a device
    was lost."""
    try:
        release()
    except Exception as e:  # noqa: BLE001 - reported; failure is what the caller raises
        report_cleanup_error(e, failure)


class BatchBase:
    """What the batches share: finish(), the with-block protocol, and
    positions / gather / accumulate for a batch that looks rows up by key."""

    #: Whether gather writes straight into the columns of a wider matrix (a
    #: model's input) natively; else a lookup gathers into a tensor of its own
    #: (gather_tensor) and the model's input is put together from it.
    gathers_into_columns = False
    #: (thread id, how) of the thread that holds the batch (holding), or None.
    _held_by: Optional[tuple] = None

    def positions(self, keys: np.ndarray) -> np.ndarray:
        """The keys themselves (flattened): gather and accumulate look them up."""
        return np.ascontiguousarray(keys).reshape(-1)

    def gather(self, positions: np.ndarray, out: Optional[np.ndarray] = None, worker: int = 0) -> np.ndarray:
        rows = self.pull(positions, worker=worker)
        if out is None:
            return rows
        out[...] = rows.reshape(out.shape)
        return out

    def accumulate(self, positions: np.ndarray, grads: np.ndarray, worker: int = 0) -> None:
        if len(positions) == 0:
            # (a multi-hot field none of the batch's examples has a key in): nothing to
            # add, and no width to infer, which numpy refuses for (0, -1)
            return
        grads = np.ascontiguousarray(grads, dtype=np.float32).reshape(len(positions), -1)
        self.push(positions, grads, worker=worker)

    def gather_tensor(self, positions: np.ndarray, out, worker: int = 0):
        """gather() into a torch tensor `out` (n, dim), float32 and contiguous, on
        any device; here through host memory (pinned for a GPU's tensor). A
        batch whose tier reads and writes the GPU's memory itself overrides it."""
        if out.device.type == "cpu":
            self.gather(positions, out.numpy(), worker=worker)
            return out
        import torch
        host = torch.empty(tuple(out.shape), dtype=torch.float32, pin_memory=True)
        self.gather(positions, host.numpy(), worker=worker)
        out.copy_(host, non_blocking=True)
        return out

    def accumulate_tensor(self, positions: np.ndarray, grads, worker: int = 0) -> None:
        """accumulate() of a torch tensor's gradients (n, dim), on any device."""
        import torch
        self.accumulate(positions, grads.detach().to("cpu", torch.float32).contiguous().numpy(), worker=worker)

    def _stage(self) -> Optional[str]:
        """Where the batch is: "made" (its step not yet applied), "applied" (not yet
        written back), or None (written back, or aborted). What a push of its server
        waits for (ParameterServer._batch_in_the_way); the batches
        ParameterServer.batch makes say it."""
        return None

    def finish(self) -> None:
        """apply(), then write_back()."""
        self.apply()
        self.write_back()

    def __enter__(self):
        self._held_by = (threading.get_ident(), "its with block")  # (held_here: this thread finishes it at the end)
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self.finish()
            else:
                release_after(exc, self.abort)  # the block's error stands
        finally:
            self._held_by = None


@contextmanager
def holding(batch, where: str):
    """Marks `batch` as held by this thread for the block (`where` says how, for
    errors): the thread finishes it only after the block, so a call of its server
    from this thread that waits for it to be written back would wait forever
    (ParameterServer refuses one: held_here). A with block of a batch holds it;
    so does the pipeline's train step, which applies the batch once the step returns."""
    before = getattr(batch, "_held_by", None)
    batch._held_by = (threading.get_ident(), where)
    try:
        yield batch
    finally:
        batch._held_by = before


def held_here(batch) -> Optional[str]:
    """How this thread holds `batch` (holding's `where`), or None: not this thread."""
    held = getattr(batch, "_held_by", None)
    return held[1] if held is not None and held[0] == threading.get_ident() else None


class StopsAfterAFailedStep:
    """For state kept across batches beside a scheduler's snapshot (Herald's
    caches on one node and across ranks): a step that fails halfway leaves the
    tables and the snapshot out of step, so the owner refuses further use (the
    last checkpoint is whole). A subclass sets ``_resume_hint`` and calls
    ``_init_fail_stop()``."""

    _resume_hint = "reopen the parameter server to resume from its last checkpoint"
    _what = "the caches"

    def _init_fail_stop(self) -> None:
        self._lock = threading.RLock()
        self._failed: Optional[str] = None

    def check(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"{self._what} stopped after a failed batch ({self._failed}); {self._resume_hint}")

    def fail(self, why: str) -> None:
        """Stops the owner for `why`; the first reason stays. A failed step is
        followed by the aborts of its batch and of those made after it (the
        pipeline's cleanup), each a reason to stop too: the last one's took the
        cause's place, and every later call said only that a batch was aborted."""
        if self._failed is None:
            self._failed = why

    @contextmanager
    def step(self, check: bool = True):
        """Under the lock; any exception marks the owner failed and propagates."""
        with self._lock:
            if check:
                self.check()
            try:
                yield
            except BaseException as e:
                self.fail(f"{type(e).__name__}: {e}")
                raise


class RunsInMadeOrder:
    """For an owner whose batches are scheduled when they are made (the
    pipeline's load stage, while the batch before trains) and run later: they
    start in the order they were made, each after the one before it applied;
    what the snapshot held before each pending batch (scheduled, not applied)
    is kept for a flush in the meantime. With StopsAfterAFailedStep (a failed
    owner counts nothing applied). ``_unit`` and ``_units`` name a batch in errors."""

    _unit, _units = "batch", "batches"

    def _init_made_order(self) -> None:
        # Batches are made on one thread (the loader) and run on another.
        self._scheduling = threading.Lock()
        self._made = 0
        self._applied = 0  # the next batch to start is the one made as number _applied
        self._pending: collections.deque = collections.deque()  # (number, held) oldest first

    def _made_one(self, held) -> int:
        """Under _scheduling: numbers the batch being made; `held`, the snapshot's
        caches before it (None: not kept)."""
        number = self._made
        self._made += 1
        if held is not None:
            self._pending.append((number, held))
        return number

    def _begin(self, number: int) -> None:
        """Batch `number` starts: the owner has not failed, and the batch before
        it applied (out of order: RuntimeError, the owner unharmed)."""
        self.check()
        with self._scheduling:
            if number != self._applied:
                raise RuntimeError(f"Herald {self._units} start in the order they were made, each after the one "
                                   f"before it applied: {self._unit} {number} started after {self._applied} applied")

    def _finished(self, number: int) -> None:
        """Batch `number` applied (or was aborted): it is no longer pending."""
        with self._scheduling:
            self._pending = collections.deque(p for p in self._pending if p[0] != number)
            if self._failed is None:
                self._applied += 1

    def _as_applied(self, live):
        """Under _scheduling: the caches as the last applied batch left them: what
        the oldest pending batch's schedule found, else live() (none pending)."""
        return self._pending[0][1] if self._pending else live()
