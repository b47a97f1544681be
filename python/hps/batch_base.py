"""What every working batch shares (hps.parameter_server's device-tier and host
batches, Herald's batches on one node and across ranks): finish(), the with-block
protocol, and positions / gather / accumulate for a batch that looks rows up by key."""
from __future__ import annotations

from typing import Optional

import numpy as np


class BatchBase:
    """What the batches share: finish(), the with-block protocol, and
    positions / gather / accumulate for a batch that looks rows up by key."""

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
        grads = np.ascontiguousarray(grads, dtype=np.float32).reshape(len(positions), -1)
        self.push(positions, grads, worker=worker)

    def finish(self) -> None:
        """apply(), then write_back()."""
        self.apply()
        self.write_back()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finish()
        else:
            self.abort()
