"""Lookahead (issue 16): the pipeline hands each prefetch the keys of the next K
batches, the same windows pipelined or not; the caches keep those rows."""
import numpy as np
import pytest

import hps
from hps.parameter_server import ParameterServer, ParameterServerConfig
from hps.pipeline import Pipeline


class Data:
    def __init__(self, i):
        self.keys = np.array([[i, 1000 + i]], np.uint64)
        self.labels = np.zeros(1, np.float32)


def windows(tmp_path, pipelined, k, n=9):
    ps = ParameterServer(ParameterServerConfig(dim=4, path=str(tmp_path / f"{pipelined}{k}"), mem_budget="1MiB",
                                               lookahead=k))
    seen = []
    real = ps.prefetch

    def prefetch(keys, upcoming=None):
        seen.append((int(keys[0, 0]), None if upcoming is None else [int(u[0, 0]) for u in upcoming]))
        return real(keys, upcoming=upcoming)

    ps.prefetch = prefetch
    Pipeline(ps, lambda loaded: None).run([Data(i) for i in range(n)], pipelined=pipelined)
    return seen


@pytest.mark.parametrize("k", [0, 1, 3])
def test_each_prefetch_gets_the_next_k_batches_pipelined_or_not(tmp_path, k):
    expect = [(i, None if k == 0 else list(range(i + 1, min(i + 1 + k, 9)))) for i in range(9)]
    assert windows(tmp_path, False, k) == expect
    for _ in range(3):  # the reader's pace changes nothing
        assert windows(tmp_path, True, k) == expect


def test_lookahead_is_checked(tmp_path):
    with pytest.raises(ValueError, match=r"lookahead must be an int >= 0 \(batches\), got -1"):
        ParameterServer(ParameterServerConfig(dim=4, path=str(tmp_path / "a"), lookahead=-1))
    ps = ParameterServer(ParameterServerConfig(dim=4, path=str(tmp_path / "b"), lookahead=5))
    with pytest.raises(ValueError, match=r"lookahead must be an int in \[0, 4\] \(the read queue's depth\), got 5"):
        Pipeline(ps, lambda loaded: None)
    with pytest.raises(TypeError, match=r"upcoming\[1\] must be an array of uint64 or int64, got float64"):
        ps.prefetch(np.array([1, 2], np.uint64), upcoming=[np.array([3], np.uint64), np.array([1.5])])
