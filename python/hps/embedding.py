"""An embedding table with a fused sparse optimizer, over one HashTable."""
from __future__ import annotations

import numpy as np

from hps.hash_table import HashTable
from hps.optim import AdaGrad, Initializer, Optimizer, Uniform, native_optimizer


class EmbeddingTable:
    """Embeddings of width ``dim`` keyed by uint64, trained by a sparse optimizer.

    pull(keys) returns float32 rows of shape (n, dim), initialising unseen keys
    from (seed, key); push(keys, grads) sums the gradients of each distinct key
    and applies one optimizer step to it.

    >>> import numpy as np, hps
    >>> emb = hps.EmbeddingTable(capacity=1000, dim=4, optimizer=hps.SGD(lr=0.5))
    >>> keys = np.array([3, 3], dtype=np.uint64)
    >>> before = emb.pull(keys[:1])
    >>> emb.push(keys, np.ones((2, 4), dtype=np.float32))   # one step with g = 2
    >>> bool(np.allclose(emb.pull(keys[:1]), before - 1.0))
    True
    """

    def __init__(self, capacity: int, dim: int, *, optimizer: Optimizer = AdaGrad(),
                 initializer: Initializer = Uniform(), seed: int = 0, threads: int = 0,
                 device: str = "cpu"):
        self.optimizer = optimizer
        self.initializer = initializer
        self.native_optimizer = native_optimizer(dim, optimizer, initializer, seed)
        self.table = HashTable(capacity, self.native_optimizer.row_floats, threads=threads,
                               device=device)

    @property
    def dim(self) -> int:
        return self.native_optimizer.dim

    def __len__(self) -> int:
        return len(self.table)

    def pull(self, keys: np.ndarray) -> np.ndarray:
        return self.table.lookup_or_init(keys, self.native_optimizer)

    def push(self, keys: np.ndarray, grads: np.ndarray) -> None:
        self.table.apply_gradients(keys, grads, self.native_optimizer)
