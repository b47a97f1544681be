"""The 4-stage training pipeline (the MLSys 2020 paper's Algorithm 1).

    read -> prefetch -> load -> train -> write back

- read: the next batch of examples from the data source;
- prefetch: pin the batch's working set in MEM-PS, reading SSD-PS for misses;
- load: put the working set on a free device tier and cut the batch into one
  mini-batch per device;
- train: the caller's step over the mini-batches (pulls, pushes, dense update), then
  the optimizer step of the sparse rows on the device tier (Batch.apply);
- write back: the updated rows to MEM-PS, the device tier freed.

Each stage is a thread (train runs in the caller's), joined by bounded queues, so
reading and SSD I/O of later batches hide behind the training of the current one.
Two device tiers take turns: batch i+1 loads while batch i trains, and batch i's
write-back runs while batch i+1 trains. Before its first pull, batch i+1 takes
the rows batch i updated from batch i (ParameterServer.batch(overlap=True)), so the
pipelined run computes exactly what running the stages one after another does.

Per-stage busy times, waits and queue depths are in ``PipelineStats``; the stage
with the largest busy time bounds the run. What the train step does that is not
training (hps train's periodic evaluations) it runs in ``Pipeline.set_aside()``,
outside the train stage's busy time.

The read, prefetch, load and write-back threads run at a lower priority (Linux
niceness ``helper_nice``, 19 by default). A trainer that runs its dense step on
every core (torch's intra-op threads) waits at each parallel op for its slowest
thread, so a helper that takes a core from one of them stalls all of them; at a
lower priority the helpers run in the trainer's serial gaps instead. When a
helper's stage bounds the run the trainer waits on its queue, its cores are
idle, and the helper gets them whatever its niceness (400k examples of W5:
+8% examples/s; see docs/training.md).
"""
from __future__ import annotations

import collections
import contextlib
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np

from hps.batch_base import holding, report_cleanup_error
from hps.mem_cache import CacheFullError
from hps.parameter_server import ParameterServer, WorkingBatch

STAGES = ("read", "prefetch", "load", "train", "write_back")
_DONE = object()
#: The bounded queues' sizes after read, prefetch and load (Pipeline's default ``depths``).
DEPTHS = (4, 1, 1)


#: The most batches a lookahead window holds: the read queue grows to hold them.
MAX_LOOKAHEAD = 64


def depths_for(lookahead: int) -> tuple:
    """The queues' sizes for a lookahead window of `lookahead` batches: DEPTHS, with
    a read queue that holds the window (the prefetch of batch i waits for batches
    i+1..i+K to be read)."""
    return (max(DEPTHS[0], lookahead),) + tuple(DEPTHS[1:])


def batches_ahead(depths=DEPTHS) -> int:
    """The most batches a pipelined run's read stage has read past the one being
    trained: one in each queue slot, and one held by each of the reader (read,
    waiting for room), the prefetcher and the loader. What the read stage does to a
    batch as it reads it (hps.admission counts its keys) runs this far ahead."""
    return sum(depths) + 3


@dataclass
class PipelineStats:
    """A run's counters. ``busy_seconds`` is each stage's wall time in its work: on
    a loaded machine it includes a thread's waits for a core and for the GIL, and
    the largest bounds the run. ``cpu_seconds`` is the CPU time of the thread that
    ran each stage's work (``time.thread_time``), without those waits. It counts
    that thread only: not torch's intra-op threads in the train stage, nor
    pyarrow's parser threads in the read stage, so it understates the work of
    stages that hand work to threads of their own; the busy (wall) time remains
    what bounds the run. ``set_aside_seconds`` is the wall time the train step spent
    in ``Pipeline.set_aside()`` (hps train's periodic evaluations): in
    ``wall_seconds``, in no stage's busy or CPU time."""
    batches: int = 0
    examples: int = 0
    wall_seconds: float = 0.0
    set_aside_seconds: float = 0.0
    busy_seconds: dict = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    cpu_seconds: dict = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    queue_depth_sum: dict = field(default_factory=lambda: {"read": 0, "prefetch": 0, "load": 0, "write_back": 0})
    queue_samples: int = 0
    prefetch_waits: int = 0  # times the prefetch waited for MEM-PS room
    helper_nice: Optional[int] = None  # the helper threads' niceness; None: left as they were
    binding: dict = field(default_factory=dict)  # helper thread -> the cores it got and why (a binding plan given)

    def bound_by(self) -> str:
        """The stage that bounds the run: the most busy one."""
        return max(self.busy_seconds, key=self.busy_seconds.get)

    def as_dict(self) -> dict:
        busy = dict(self.busy_seconds)
        slowest = max(busy.values())
        n = max(self.queue_samples, 1)
        return {"batches": self.batches, "examples": self.examples, "wall_seconds": self.wall_seconds,
                "examples_per_s": self.examples / self.wall_seconds if self.wall_seconds else 0.0,
                "busy_seconds": busy, "cpu_seconds": dict(self.cpu_seconds), "bound_by": self.bound_by(),
                "set_aside_seconds": self.set_aside_seconds,
                "wall_over_slowest_stage": self.wall_seconds / slowest if slowest else None,
                "mean_queue_depth": {k: v / n for k, v in self.queue_depth_sum.items()},
                "prefetch_waits": self.prefetch_waits, "helper_nice": self.helper_nice, "binding": self.binding}


@dataclass
class Loaded:
    """A batch on the device tier, with its examples cut into per-device mini-batches."""
    data: Any                  # the reader's batch (labels, dense, keys)
    batch: WorkingBatch        # the batch's working set (any kind: device tier, in place, distributed)
    minibatches: list          # one index array per device
    read: Any = None           # the reader's batch, where a batch that moves examples between
    #                            ranks (Herald's) made data the examples this rank trains


TrainStep = Callable[[Loaded], None]


class Pipeline:
    """Runs `train_step` over the batches of `source` through the four stages.

    ``keys_of(data)`` gives a batch's keys (default: ``data.keys``); ``depths`` are
    the bounded queues' sizes after read, prefetch and load; ``helper_nice`` is
    the niceness (0-19) of the threads of the stages other than train, on Linux
    (elsewhere a niceness is per process, and it is left alone). ``binding``, a
    ``hps.topology.BindingPlan``, pins each helper thread of a pipelined run to its
    stage's cores (default None: threads run where the kernel puts them); stats
    say which cores each got and why.

    ``lookahead`` (default: the server's ``config.lookahead``, else 0) hands the
    prefetch of batch i the keys of batches i+1 .. i+K (``ps.prefetch(keys,
    upcoming=[...])``), so that the caches keep rows those batches need. The
    window is always the next K batches (fewer only at the end of the data): the
    prefetch waits for the reader to have read them, so a pipelined run sees the
    windows a sequential one does. K is at most MAX_LOOKAHEAD; the read queue
    holds K batches (``depths_for``), or, with ``depths`` given, K is at most its
    read queue's depth.

    ``on_error(e)`` (default None) is called with each exception a stage raises, in
    the thread that raised it, before the run stops its other stages and joins
    their threads (then run() raises the first). A distributed job ends itself
    there (hps.train): a stage of another thread may be waiting in a collective for
    peers that wait in turn for the stage that failed, so the join would never end.
    """

    def __init__(self, ps: ParameterServer, train_step: TrainStep, *, devices: Optional[int] = None,
                 keys_of: Callable[[Any], np.ndarray] = lambda d: d.keys, depths=None,
                 helper_nice: int = 19, binding=None, lookahead: Optional[int] = None,
                 on_error: Optional[Callable[[BaseException], None]] = None):
        if isinstance(helper_nice, bool) or not isinstance(helper_nice, int) or not 0 <= helper_nice <= 19:
            raise ValueError(f"helper_nice must be an int in [0, 19], got {helper_nice!r}")
        if lookahead is None:
            lookahead = getattr(getattr(ps, "config", None), "lookahead", 0)
        most, why = (MAX_LOOKAHEAD, "batches") if depths is None else (depths[0], "the read queue's depth")
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or not 0 <= lookahead <= most:
            raise ValueError(f"lookahead must be an int in [0, {most}] ({why}), got {lookahead!r}")
        if depths is None:
            depths = depths_for(lookahead)
        self.lookahead = lookahead
        self.on_error = on_error
        self._upcoming: collections.deque = collections.deque()  # keys of batches read, not yet prefetched
        self._reading = threading.Condition()  # guards _upcoming and _read_all
        self._read_all = False
        self.helper_nice = helper_nice
        self.binding = binding
        self.ps = ps
        self.train_step = train_step
        self.devices = devices or ps.config.devices
        self.keys_of = keys_of
        self.depths = depths
        self.stats = PipelineStats()
        self._lock = threading.Lock()
        self._written_back = threading.Condition(self._lock)  # a batch let go of its pins
        self._in_flight = 0  # prefetched batches not yet written back
        self._applied_not_written = 0  # batches the train stage applied, not yet written back
        self._stop: Optional[threading.Event] = None  # a pipelined run's: set when its stages stop

    # ------------------------------------------------------------ stages
    def _timed(self, stage: str, fn, *args, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
        with self._lock:
            self.stats.busy_seconds[stage] += wall
            self.stats.cpu_seconds[stage] += cpu
        return out

    @contextlib.contextmanager
    def set_aside(self):
        """A block of the train step that is not training: hps train's periodic
        evaluations, which run between two batches. Counted as the train stage's busy
        time, they made a run whose evaluations dominate look bound by train whatever
        bounded its training. The block's wall and CPU time are left out of the train
        stage's busy_seconds and cpu_seconds and counted in stats.set_aside_seconds.
        REQUIRES: called in the train step (the thread that runs it)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            with self._lock:  # (the step's _timed adds the whole step, this block in it, when it returns)
                self.stats.busy_seconds["train"] -= wall
                self.stats.cpu_seconds["train"] -= cpu
                self.stats.set_aside_seconds += wall

    def wait_for_write_backs(self) -> None:
        """Waits until the batches trained before the one in the train step are
        written back. A pipelined run writes a batch back while the next one trains,
        so a read of the server in the step (hps train's periodic evaluations, which
        pull from MEM-PS) found the rows of the batch before half written, or not at
        all, as the writer's pace had it: its metrics differed from a sequential run's
        and from run to run. After this wait the server holds what a sequential run's
        holds there: every batch before applied and written back, the one in the step
        not applied. Returns at once when the run's stages are stopping (a stage
        failed: its error ends the run). REQUIRES: called in the train step (the
        thread that runs it)."""
        with self._lock:
            while self._applied_not_written and not (self._stop is not None and self._stop.is_set()):
                self._written_back.wait(timeout=0.1)

    def _load(self, data, prefetched, overlap: bool = False) -> Loaded:
        b = self.ps.batch(prefetched, overlap=overlap)
        with self._lock:  # waiting for the previous write-back is not work
            self.stats.busy_seconds["load"] -= b.wait_seconds
        n = len(data.labels)
        minibatches = np.array_split(np.arange(n), self.devices)
        return Loaded(data, b, minibatches)

    def _train(self, loaded: Loaded) -> None:
        """The train stage: the caller's step, then the sparse optimizer step.
        A batch that partitions its own examples (Herald's, hps.worker_caches)
        moves its rows first, here: they are the batches' before it, trained
        (its schedule ran in the load stage: it reads keys only). The caller
        aborts the batch if this raises (once the batches before it are
        written back: it may have applied its step). The step holds the batch
        (batch_base.holding): the server refuses a call of the step that would
        wait for its write-back (a push, a batch, a checkpoint), which comes only
        after the step."""
        partition = getattr(loaded.batch, "partition", None)
        if partition is not None:
            bind = getattr(loaded.batch, "bind", None)
            if bind is not None:  # a batch that moves examples between ranks sends these
                bind(loaded.data)
            loaded.minibatches = self._timed("train", partition)
            exchanged = getattr(loaded.batch, "exchanged", None)
            if exchanged is not None:  # the examples this rank trains now
                loaded.read, loaded.data = loaded.data, exchanged
        with holding(loaded.batch, "the pipeline's train step"):
            self._timed("train", self.train_step, loaded)
        self._timed("train", loaded.batch.apply)
        with self._lock:
            self._applied_not_written += 1

    def _write_back(self, loaded: Loaded) -> None:
        self._timed("write_back", loaded.batch.write_back)
        with self._lock:
            self.stats.batches += 1
            self.stats.examples += len(loaded.data.labels)
            self._in_flight -= 1
            self._applied_not_written -= 1
            self._written_back.notify_all()

    def _prefetch(self, data, stop: Optional[threading.Event] = None, upcoming=None):
        """Pins a batch; when MEM-PS has no room beside the batches in flight,
        waits for one of them to be written back (backpressure), and fails only
        when none is left to wait for: then the budget cannot hold one batch.
        ``upcoming``: the keys of the next batches (lookahead), or None."""
        keys = self.keys_of(data)
        extra = {} if upcoming is None else {"upcoming": upcoming}
        while True:
            with self._lock:
                written_before = self.stats.batches
            try:
                prefetched = self._timed("prefetch", self.ps.prefetch, keys, **extra)
            except CacheFullError:
                with self._lock:
                    # A write-back that finished during the attempt freed pins the
                    # attempt still counted: try again before judging the budget.
                    if self.stats.batches != written_before:
                        continue
                    if self._in_flight == 0 or (stop is not None and stop.is_set()):
                        raise
                    self.stats.prefetch_waits += 1
                    self._written_back.wait(timeout=1.0)
                continue
            with self._lock:
                self._in_flight += 1
            return prefetched

    def _lower_priority(self) -> None:
        """Called first in each helper thread: its niceness becomes helper_nice
        (never lower than it already is, which would need privileges)."""
        if not sys.platform.startswith("linux"):
            return
        tid = threading.get_native_id()
        try:
            nice = max(self.helper_nice, os.getpriority(os.PRIO_PROCESS, tid))
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:  # a sandbox that forbids it: the helpers run as they were
            return
        with self._lock:
            self.stats.helper_nice = nice

    def _bind(self, thread: str) -> None:
        """Called first in each helper thread: its cores from the binding plan, if any."""
        if self.binding is None:
            return
        from hps.topology import apply_binding
        got = apply_binding(self.binding, thread)
        with self._lock:
            self.stats.binding[thread] = got

    def _failed(self, e: BaseException) -> None:
        """A stage raised e: on_error hears of it before anything is joined."""
        if self.on_error is None:
            return
        try:
            self.on_error(e)
        except Exception:  # noqa: BLE001 - the stage's own error is what run() raises
            traceback.print_exc()

    @staticmethod
    def _let_go(release, failure: Optional[BaseException], left: Optional[list] = None) -> None:
        """Cleanup after a failure: release() (a batch's abort, a prefetch's release).
        An error of its own (an unpin of a key something else unpinned) must not
        take the place of the error that ends the run, which says what failed: it
        took it, and in a pipelined run it also cut the cleanup short (stages left
        running, queued batches keeping their pins). It goes to stderr while
        `failure` is in flight, else into `left` (the run raises it, having no
        other error)."""
        try:
            release()
        except Exception as e:  # noqa: BLE001 - reported, the cleanup goes on
            if failure is None and left is not None:
                left.append(e)
            else:
                report_cleanup_error(e, failure)

    # ------------------------------------------------------------ runs
    def run(self, source: Iterable, pipelined: bool = True) -> PipelineStats:
        self._in_flight = 0  # whatever a previous run left in flight it released
        self._applied_not_written = 0
        self._stop = None
        t0 = time.perf_counter()
        try:
            if pipelined:
                self._run_pipelined(iter(source))
            else:
                try:
                    self._run_sequential(iter(source))
                except BaseException as e:
                    self._failed(e)
                    raise
        finally:
            self.stats.wall_seconds += time.perf_counter() - t0
        return self.stats

    def _run_sequential(self, it: Iterator) -> None:
        ahead: collections.deque = collections.deque()  # batches read for the lookahead window
        while True:
            while len(ahead) < 1 + self.lookahead:
                data = self._timed("read", next, it, _DONE)
                if data is _DONE:
                    break
                # Each batch's keys taken once: the same arrays in each window let
                # prefetch slide MEM-PS's window rather than set it anew.
                ahead.append((data, self.keys_of(data) if self.lookahead else None))
            if not ahead:
                return
            data, _ = ahead.popleft()
            upcoming = [keys for _, keys in ahead] if self.lookahead else None
            prefetched = self._prefetch(data, upcoming=upcoming)
            loaded = self._timed("load", self._load, data, prefetched)
            try:
                self._train(loaded)
                self._write_back(loaded)
            except BaseException as e:
                # Not written back (a failed step, an interrupt): the batch lets go
                # of its pins and device tier, keeping a step it applied.
                self._let_go(loaded.batch.abort, e)
                raise

    def _run_pipelined(self, it: Iterator) -> None:
        with self._reading:  # a window ends with the run's batches (as a sequential run's does)
            self._upcoming.clear()
            self._read_all = False
        q_read, q_prefetch, q_load = (queue.Queue(maxsize=d) for d in self.depths)
        q_write_back: queue.Queue = queue.Queue(maxsize=1)
        stop = threading.Event()
        self._stop = stop
        errors: list[BaseException] = []

        def put(q, item):
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def get(q):
            while True:
                try:
                    return q.get(timeout=0.1)
                except queue.Empty:
                    if stop.is_set():
                        return _DONE

        def reader():
            self._lower_priority()
            self._bind("reader")
            try:
                while not stop.is_set():
                    data = self._timed("read", next, it, _DONE)
                    if self.lookahead:
                        with self._reading:
                            if data is _DONE:
                                self._read_all = True
                            else:
                                self._upcoming.append(self.keys_of(data))
                            self._reading.notify_all()
                    if not put(q_read, data) or data is _DONE:
                        return
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                errors.append(e)
                self._failed(e)
                put(q_read, _DONE)
            finally:
                with self._reading:
                    self._read_all = True
                    self._reading.notify_all()

        def window():
            """The keys of the next `lookahead` batches after the one just taken
            from the read queue, once the reader has read them (or all there is)."""
            if not self.lookahead:
                return None
            with self._reading:
                while len(self._upcoming) < 1 + self.lookahead and not self._read_all and not stop.is_set():
                    self._reading.wait(0.1)
                if self._upcoming:
                    self._upcoming.popleft()  # the batch being prefetched
                return list(self._upcoming)[:self.lookahead]

        def prefetcher():
            self._lower_priority()
            self._bind("prefetcher")
            try:
                while True:
                    data = get(q_read)
                    if data is _DONE:
                        put(q_prefetch, _DONE)
                        return
                    prefetched = self._prefetch(data, stop, window())
                    if not put(q_prefetch, (data, prefetched)):
                        prefetched.release()
                        return
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                self._failed(e)
                put(q_prefetch, _DONE)

        def loader():
            self._lower_priority()
            self._bind("loader")
            try:
                while True:
                    item = get(q_prefetch)
                    if item is _DONE:
                        put(q_load, _DONE)
                        return
                    loaded = self._timed("load", self._load, *item, True)
                    if not put(q_load, loaded):
                        loaded.batch.abort()
                        return
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                self._failed(e)
                put(q_load, _DONE)

        def writer():
            self._lower_priority()
            self._bind("writer")
            try:
                while True:
                    loaded = get(q_write_back)
                    if loaded is _DONE:
                        return
                    self._write_back(loaded)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                self._failed(e)
                stop.set()

        threads = [threading.Thread(target=f, name=f"hps-{f.__name__}", daemon=True)
                   for f in (reader, prefetcher, loader)]
        write_back = threading.Thread(target=writer, name="hps-writer", daemon=True)
        write_back.start()
        for t in threads:
            t.start()
        held = None  # the batch the train stage holds, not yet handed to the writer
        failure: Optional[BaseException] = None  # the train stage's error
        left: list[BaseException] = []  # the cleanup's own errors, where nothing else failed
        try:
            while True:
                loaded = get(q_load)
                if loaded is _DONE:
                    break
                held = loaded
                with self._lock:
                    self.stats.queue_samples += 1
                    self.stats.queue_depth_sum["read"] += q_read.qsize()
                    self.stats.queue_depth_sum["prefetch"] += q_prefetch.qsize()
                    self.stats.queue_depth_sum["load"] += q_load.qsize()
                    self.stats.queue_depth_sum["write_back"] += q_write_back.qsize()
                self._train(loaded)
                if not put(q_write_back, loaded):  # the writer stopped
                    break
                held = None
        except BaseException as e:
            failure = e
            self._failed(e)  # (the train stage: before the joins below)
            raise
        finally:
            # The write-backs of trained batches finish; then the other stages stop.
            put(q_write_back, _DONE)
            write_back.join()
            stop.set()

            def let_go(release):
                # (a stage's error, if not the train stage's: the first, as run() raises)
                self._let_go(release, failure if failure is not None else (errors[0] if errors else None), left)

            def let_go_of(queues):
                """Whatever waits in the queues lets go of its pins and device tier
                (a batch trained keeps its step: abort writes it back)."""
                for q in queues:
                    while True:
                        try:
                            item = q.get_nowait()
                        except queue.Empty:
                            break
                        if isinstance(item, Loaded):
                            let_go(item.batch.abort)
                        elif isinstance(item, tuple):
                            let_go(item[1].release)

            # Batches trained and not written back (the writer failed) go in the
            # order they trained, and then the one the train stage held (its step
            # failed, the writer stopped, or an interrupt came before the hand-off;
            # it may have applied its step): each holds the rows of the one before
            # it, with its own step on top, so a batch written back before the one
            # ahead of it would have its rows overwritten with older ones (a tier
            # holding copies).
            let_go_of([q_write_back])
            if held is not None:
                let_go(held.batch.abort)  # nothing, if the writer took it before the interrupt
            # The loader may be waiting in ps.batch, with no way out, for a device
            # tier (or a host batch's turn) that a queued batch holds: the queues
            # let go while the stages stop, not only after.
            for t in threads:
                while t.is_alive():
                    let_go_of([q_prefetch, q_load])
                    t.join(timeout=0.1)
            let_go_of([q_prefetch, q_load])  # what a stage put as the stop came
        if errors:
            for e in left:
                report_cleanup_error(e, errors[0])
            raise errors[0]
        if left:
            raise left[0]
