"""The device-tier hash table, as a Python class over the native launchers."""
from __future__ import annotations

from hps import _core

#: The key reserved to mark empty slots (all 64 bits set; -1 as int64).
EMPTY_KEY: int = _core.EMPTY_KEY


def parse_device(device: str) -> int:
    """Map "cpu" to -1 and "cuda" / "cuda:N" to the CUDA ordinal N."""
    if device == "cpu":
        return -1
    if device == "cuda":
        return 0
    prefix = "cuda:"
    if device.startswith(prefix) and device[len(prefix):].isdigit():
        return int(device[len(prefix):])
    raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


class HashTable(_core.HashTable):
    """Fixed-capacity open-addressing table of uint64 keys to float32 rows.

    Rows have ``row_floats`` values (an embedding and its optimizer state).
    Keys are 1-D uint64 (or int64, reinterpreted) arrays; rows are C-contiguous
    float32 arrays of shape (n, row_floats). The table never grows: keep it
    below ~80% full; a claim that finds no free slot raises TableFullError.

    >>> import numpy as np, hps
    >>> t = hps.HashTable(capacity=1024, row_floats=4)
    >>> keys = np.array([7, 11], dtype=np.uint64)
    >>> t.insert(keys, np.ones((2, 4), dtype=np.float32)).tolist()
    [True, True]
    >>> rows, found = t.find(np.array([7, 8], dtype=np.uint64))
    >>> found.tolist(), rows[0].tolist()
    ([True, False], [1.0, 1.0, 1.0, 1.0])

    Operations: insert (absent keys only; returns an inserted mask), find
    (rows, found mask), accumulate (adds; absent keys start at zero; duplicates
    sum), assign (present keys only; returns a found mask), lookup_or_init and
    apply_gradients (with a SparseOptimizer), export() -> (keys, rows), clear().

    ``threads`` sets the CPU launcher's parallelism (0 = all cores); ``device``
    is "cpu" or "cuda:N".
    """

    def __init__(self, capacity: int, row_floats: int, *, threads: int = 0, device: str = "cpu"):
        super().__init__(capacity, row_floats, threads, parse_device(device))
        self._built = True

    def __repr__(self) -> str:
        if not getattr(self, "_built", False):  # its __init__ raised: the methods raise (see MemCache's)
            return "HashTable(not built: its constructor raised)"
        return (f"HashTable(capacity={self.capacity}, row_floats={self.row_floats}, "
                f"size={self.size}, device={self.device!r})")
