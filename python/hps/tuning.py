"""torch on the trainer's cores, beside the pipeline's stage threads: imported with
idle OpenMP workers told to sleep (:func:`import_torch`), the dense step by torch's
fused Adam (:func:`dense_adam`, which the benchmarks' peers share), the
intra-op thread count chosen while a run goes (:class:`ThreadTuner`), and the
memory a step frees kept for the next (:func:`keep_freed_memory`).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import sys
import time
from typing import Optional

__all__ = ["ThreadTuner", "dense_adam", "import_torch", "keep_freed_memory", "usable_cpus"]

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc takes on 64-bit (its DEFAULT_MMAP_THRESHOLD_MAX).
_MMAP_THRESHOLD_MAX = 32 << 20


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (taskset, a cpuset, a
    scheduler's binding), which os.cpu_count() ignores, counting the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # (no such call on macOS and Windows)
        return os.cpu_count() or 1


def import_torch():
    """torch, with its OpenMP workers told to sleep when idle if torch was not
    imported yet. By default they spin for a while after each parallel region;
    beside the pipeline's stage threads, a spinning worker holds a core the
    prefetch or the write-back needs (W4: 37k -> 45k examples/s on 2 cores)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    return torch


def keep_freed_memory(trim_bytes: int = 256 << 20) -> dict:
    """Tells glibc's malloc to keep the memory a training step frees for the next
    step, instead of giving it back to the kernel. Returns what it set, or why it
    set nothing.

    Each step allocates a few tensors of several MB (a batch's MLP input and its
    gradient: 4096 x 429 floats, 7 MB, on W4's data) and frees them at its end.
    By default glibc serves them with mmap, or from the heap's top, which it
    trims back to the kernel once more than twice the last such block is free,
    so every step faults those pages in again and the kernel zeroes each one,
    on the trainer's thread. Here
    blocks up to 32 MiB come from the heap and up to `trim_bytes` of free heap
    is kept. It applies to the whole process and stays after training; it is
    the setting most allocators (jemalloc, tcmalloc) have by default."""
    if not isinstance(trim_bytes, int) or isinstance(trim_bytes, bool) or not 0 < trim_bytes < 1 << 31:
        raise ValueError(f"trim_bytes must be an int in (0, 2^31), got {trim_bytes!r}")
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return {"kept": False, "reason": f"malloc is not glibc's here ({sys.platform}, "
                                         f"{platform.libc_ver()[0] or 'unknown libc'})"}
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError) as e:
        return {"kept": False, "reason": f"no mallopt: {e}"}
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) or not mallopt(_M_TRIM_THRESHOLD, trim_bytes):
        return {"kept": False, "reason": "mallopt refused the thresholds"}
    return {"kept": True, "mmap_threshold_bytes": _MMAP_THRESHOLD_MAX, "trim_threshold_bytes": trim_bytes}


def dense_adam(params, lr: float):
    """torch.optim.Adam over the dense parameters, with torch's fused CPU kernel
    where this torch has one (2.4 and later): one pass over each tensor instead
    of a dozen small ops, which the trainer's thread runs between its parallel
    ones (W5's 512-256-1 MLP on 2 cores: 2.7-3.9 -> 0.8-1.0 ms a step). The
    benchmarks' peers use it too, so they and hps take the same dense step."""
    torch = import_torch()
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except (RuntimeError, TypeError, ValueError):  # no fused kernel for these parameters here
        return torch.optim.Adam(params, lr=lr)


class ThreadTuner:
    """Chooses torch's intra-op threads (TrainConfig.torch_threads = 0) while the
    run goes, ``cores`` being the CPUs the process may use (:func:`usable_cpus`): a few batches of warm-up, then probes of ``probe`` batches with every
    core (A) and with one fewer (B) in the order A B B A, so that a run that speeds
    up or slows down as it goes (caches filling) favours neither; then one fewer
    for the rest of the run if it was at least 5% faster, else every core. A
    verdict for one fewer is checked by a second A B B A before it holds: a
    wrong drop costs the most (W5 on a noisy machine: one pass picked 1 thread
    and that run trained at 21k examples/s against 28-30k with 2). When the first
    A and B already show every core CLEAR x faster, the pass stops there: no drift
    makes a gap that wide, and each probe batch on one fewer thread costs (W5: 8
    more batches at 27-38k examples/s against 46-56k with 2).

    The pipeline's stages share the cores with torch: a small MLP gains less from
    a second thread than they lose (W4s on 2 cores: 146k examples/s with 1 thread,
    118k with 2), a large one more (W4: 31k with 1, 45k with 2). The thread count
    may change the order in which torch's kernels sum: runs that must match bit
    for bit (a resumed run and its straight twin, say) fix torch_threads."""

    SETTLE = 2  # batches after a change of threads before a probe starts timing
    MARGIN = 1.05  # one fewer thread must be this much faster: probes are noisy, all cores is torch's way
    CLEAR = 1.25   # all cores this much faster after one probe each: keep them, skip the probes left

    def __init__(self, torch, cores: int, warmup: int = 6, probe: int = 8):
        for name, value in (("cores", cores), ("warmup", warmup), ("probe", probe)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                # (warmup's last batch starts the first probe's clock: none would leave it unset)
                raise ValueError(f"ThreadTuner: {name} must be an int >= 1, got {value!r}")
        self.torch = torch
        self.candidates = [cores, cores - 1] if cores > 1 else [1]
        self.schedule = [cores, cores - 1, cores - 1, cores] if cores > 1 else []
        self.warmup, self.probe = warmup, probe
        self.rates: dict[int, float] = {}  # of the last pass
        self.passes = 0
        self.chosen: Optional[int] = None if self.schedule else 1
        self._totals = {c: [0, 0.0] for c in self.candidates}  # examples, seconds
        self._probe = 0          # index into schedule
        self._skip = warmup      # batches still to let pass before timing
        self._start = None
        self._batches = self._examples = 0
        torch.set_num_threads(self.candidates[0])

    def step(self, examples: int) -> None:
        """Called as each batch ends training, with its examples."""
        if self.chosen is not None:
            return
        now = time.perf_counter()
        if self._skip > 0:
            self._skip -= 1
            if self._skip == 0:
                self._start, self._batches, self._examples = now, 0, 0
            return
        self._batches += 1
        self._examples += examples
        if self._batches < self.probe:
            return
        threads = self.schedule[self._probe]
        self._totals[threads][0] += self._examples
        self._totals[threads][1] += now - self._start
        self._probe += 1
        every, fewer = self.candidates
        rates = {c: e / t for c, (e, t) in self._totals.items() if t > 0}
        # All cores this much faster is no drift: the pass need not finish.
        clear = len(rates) == 2 and rates[every] > self.CLEAR * rates[fewer]
        if self._probe == len(self.schedule) or clear:
            self.rates = rates
            self.passes += 1
            faster = self.rates[fewer] > self.MARGIN * self.rates[every]
            if not faster or self.passes == 2:
                self.chosen = fewer if faster else every
                self.torch.set_num_threads(self.chosen)
                return
            self.schedule = self.schedule + [every, fewer, fewer, every]  # the second pass
            self._totals = {c: [0, 0.0] for c in self.candidates}
        following = self.schedule[self._probe]
        self._start, self._batches, self._examples = now, 0, 0
        if following != threads:
            self.torch.set_num_threads(following)
            self._skip = self.SETTLE

    @contextlib.contextmanager
    def untimed(self):
        """Work between two batches that is not training (an evaluation, a checkpoint),
        left out of the probe it falls in: timed, it slows that probe alone, and the
        probes would compare where it fell instead of the thread counts."""
        began = time.perf_counter()
        try:
            yield
        finally:
            if self.chosen is None and self._start is not None:
                self._start += time.perf_counter() - began

    def as_dict(self) -> dict:
        return {"chosen": self.chosen if self.chosen is not None else self.torch.get_num_threads(),
                "examples_per_s": {str(k): v for k, v in self.rates.items()}, "passes": self.passes}
