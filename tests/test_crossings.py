"""Python -> C++ crossings per batch, for each device kind (issue 15: at most 8).

Every call into hps._core during one batch is counted: calls of its functions
and methods (a profile hook sees each one, on the calling thread) and
constructions of its classes, which the hook does not see (counted by a proxy
of hps._core in hps.parameter_server). One batch is what the pipeline does
for it: prefetch (pin), batch (load), each worker's pull and push, apply,
write_back. Composed in Python, the device-tier path took 12 calls with one
host partition and 14 with two workers on two (by pull and push; hps.torch
added unique_keys and sum_by_inverse per worker); the native working set takes
6 and 8."""
import sys
import types

import numpy as np
import pytest

import hps
import hps.parameter_server as ps_module
from hps import _core

MAX_CROSSINGS = 8


def _is_core(fn) -> bool:
    """A function or method of hps._core (pybind11 gives both its module)."""
    return getattr(fn, "__module__", None) == "hps._core"


class CrossingCounter:
    """Counts calls into hps._core made by the current thread while active."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        proxy = types.ModuleType("hps._core_counted")
        proxy.__dict__.update(vars(_core))
        for name, value in vars(_core).items():
            if isinstance(value, type) and not issubclass(value, BaseException):
                proxy.__dict__[name] = self._counted_class(value)
        monkeypatch.setattr(ps_module, "_core", proxy)

    def _counted_class(self, cls):
        counter = self

        class Counted:
            def __call__(self, *args, **kwargs):
                counter.calls.append(f"{cls.__name__}()")
                return cls(*args, **kwargs)

            def __getattr__(self, name):
                return getattr(cls, name)

        return Counted()

    def _profile(self, frame, event, arg):
        if event == "c_call" and _is_core(arg):
            self.calls.append(getattr(arg, "__name__", "?"))

    def __enter__(self):
        self.calls.clear()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def one_batch(ps, keys: np.ndarray, workers: int, tensors: bool = False) -> None:
    """One batch as the pipeline and hps.torch run it: each worker gathers the
    rows of its share of the examples and accumulates their gradients (as
    arrays, or as torch tensors: a model on a GPU's way)."""
    b = ps.batch(ps.prefetch(keys), overlap=True)
    if workers == 1:
        parts = [keys]  # hps.torch asks for the batch's keys as the prefetch had them
    else:
        # Consecutive shares, views of the batch's keys as hps.train reads them
        # (_as_slice): their positions are a slice of the prefetch's, no crossing.
        parts = np.array_split(keys, workers)
    for worker, k in enumerate(parts):
        positions = b.positions(k)
        if tensors:
            import torch
            rows = b.gather_tensor(positions, torch.empty(len(positions), ps.dim), worker=worker)
            b.accumulate_tensor(positions, rows * 0.5, worker=worker)
            continue
        rows = b.gather(positions, worker=worker)
        b.accumulate(positions, np.ascontiguousarray(rows * 0.5), worker=worker)
    b.apply()
    b.write_back()


@pytest.mark.parametrize("devices,in_place,tensors", [(1, True, False), (1, False, False), (2, False, False),
                                                     (1, False, True), (2, False, True)],
                         ids=["in-place", "devices=1", "devices=2", "devices=1 tensors", "devices=2 tensors"])
def test_a_batch_crosses_into_cpp_at_most_8_times(tmp_path, monkeypatch, devices, in_place, tensors):
    if tensors:
        pytest.importorskip("torch")
    ps = hps.ParameterServer(hps.ParameterServerConfig(dim=4, path=str(tmp_path / "ps"), mem_budget="1MiB",
                                                       devices=devices, host_in_place=in_place))
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 500, size=(64, 3)).astype(np.uint64) for _ in range(3)]
    one_batch(ps, batches[0], devices, tensors)  # warm: tables sized, first misses served
    counter = CrossingCounter(monkeypatch)
    for keys in batches[1:]:
        with counter:
            one_batch(ps, keys, devices, tensors)
        assert 0 < len(counter.calls) <= MAX_CROSSINGS, f"{len(counter.calls)}: {counter.calls}"
    expected_kind = "host, in place (MEM-PS rows)" if in_place else "cpu"
    assert ps.stats()["device"]["kind"] == expected_kind
    assert ps.stats()["mem"]["pinned"] == 0
    ps.close()


def test_the_counter_sees_calls_into_core_and_constructions(monkeypatch):
    counter = CrossingCounter(monkeypatch)
    keys = np.arange(1, 5, dtype=np.uint64)
    with counter:
        ps_module._core.unique_keys(keys)                  # a function
        cache = ps_module._core.MemCache(32, 16)           # a construction
        cache.access(keys)                                 # a method
        np.unique(keys)                                    # not hps._core
    assert counter.calls == ["unique_keys", "MemCache()", "access"]
